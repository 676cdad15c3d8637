package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/shim"
)

// shimConfig writes a shim config naming the stack's API socket (plus extra TOML) and
// returns the ctr flags that select the tidepool runtime with it, as
// `nerdctl run --runtime io.containerd.tidepool.v1` would on a host whose
// /etc/tidepool/shim.toml says the same.
func shimFlags(t testing.TB, s *stack.Stack, extra string) []string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "shim.toml")
	body := fmt.Sprintf("api_address = %q\n%s", s.APIAddress, extra)
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return []string{"--runtime", shim.RuntimeName, "--runtime-config-path", p, "--snapshotter", "tidepool"}
}

func annotations(kv ...string) []string {
	var out []string
	for _, a := range kv {
		out = append(out, "--annotation", a)
	}
	return out
}

func TestShimForkFromAnnotations(t *testing.T) {
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, node.Path, imagebuild.NodeRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))

	flags := append(shimFlags(t, s, ""), annotations(
		binding.AnnotationFork+"="+root, binding.AnnotationWorkdir+"=/app")...)
	flags = append(flags, "--user", "1000:1000")
	script := "node /app/src/main.js && stat -c '%u:%g' /app/src/main.js && echo new > /app/new.txt && rm /app/src/old.js"
	out := runRm(t, s, "ann1", flags, imagebuild.NodeRef, "sh", "-c", script)
	// Without dev.tidepool.owner the fork belongs to the process user.
	if out != "hello Tidepool\n1000:1000\n" {
		t.Fatalf("container printed %q", out)
	}
	f := forkOfContainer(t, s, "ann1", root)
	if d := s.MustTidepool(t, "diff", root, f.ID); d != "A new.txt\nD src/old.js\n" {
		t.Fatalf("fork changes %q", d)
	}
	s.C.LeakCheck(t)
}

// TestShimRunsc: dev.tidepool.runtime=runsc runs the workload under gVisor (Debian's
// runsc as the OCI binary of the in-process runc route). The kernel the workload sees
// is gVisor's Sentry, not the host's.
func TestShimRunsc(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	host, err := os.ReadFile("/proc/version")
	if err != nil {
		t.Fatal(err)
	}
	// Debian's runsc cannot start sandbox networking on this kernel (see
	// contrib/runsc/runsc-nonet), so the route uses the wrapper shipped for that.
	repo, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	route := fmt.Sprintf("[runtimes.runsc]\nkind = \"runc\"\nbinary_name = %q\ncreate_netns = true\n", filepath.Join(repo, "contrib/runsc/runsc-nonet"))
	flags := append(shimFlags(t, s, route), annotations(shim.AnnotationRuntime+"=runsc")...)
	out := runRm(t, s, "gvisor", flags, imagebuild.BusyboxRef, "sh", "-c", "cat /proc/version; dmesg | head -1")
	if strings.Contains(out, strings.TrimSpace(string(host))) || !strings.Contains(strings.ToLower(out), "gvisor") {
		t.Fatalf("not gVisor: the container saw\n%s\nthe host has\n%s", out, host)
	}
	t.Logf("under runsc: %s", out)
	s.C.LeakCheck(t)
}

// taskStatus returns a task's status column from `ctr task ls` ("" if absent).
func taskStatus(t testing.TB, s *stack.Stack, id string) (pid, status string) {
	t.Helper()
	for _, line := range strings.Split(s.MustCtr(t, "task", "ls"), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == id {
			return f[1], f[2]
		}
	}
	return "", ""
}

func waitStatus(t testing.TB, s *stack.Stack, id, want string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, st := taskStatus(t, s, id); st == want {
			return
		}
		if time.Now().After(deadline) {
			_, st := taskStatus(t, s, id)
			t.Fatalf("task %s is %q, want %q", id, st, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func shimProcessesNamed(t testing.TB, s *stack.Stack, name string) []harness.Process {
	t.Helper()
	all, err := harness.ShimProcesses(s.C.Address)
	if err != nil {
		t.Fatal(err)
	}
	var out []harness.Process
	for _, p := range all {
		if len(p.Cmdline) > 0 && filepath.Base(p.Cmdline[0]) == name {
			out = append(out, p)
		}
	}
	return out
}

// TestShimDelegateRoute hands containers to another shim binary at start. Kata is not
// installable here, so the delegate is containerd's own runc shim: the same contract
// (start prints an address, containerd talks to that shim, delete is forwarded).
func TestShimDelegateRoute(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "shim.toml")
	s := stack.Start(t, stack.Options{Containerd: harness.Options{Env: []string{shim.ConfigEnv + "=" + cfg}}})
	body := fmt.Sprintf("api_address = %q\n[runtimes.runc-delegate]\nkind = \"shim\"\nshim = \"containerd-shim-runc-v2\"\nprotocol = \"bootstrap\"\n", s.APIAddress)
	if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	flags := append([]string{"--runtime", shim.RuntimeName, "--snapshotter", "tidepool"}, annotations(shim.AnnotationRuntime+"=runc-delegate")...)

	out := runRm(t, s, "once", flags, imagebuild.BusyboxRef, "echo", "delegated")
	if out != "delegated\n" {
		t.Fatalf("delegate printed %q", out)
	}

	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, flags...), imagebuild.BusyboxRef, "dlg", "sleep", "1000")...)
	waitStatus(t, s, "dlg", "RUNNING")
	if ps := shimProcessesNamed(t, s, "containerd-shim-runc-v2"); len(ps) != 1 {
		t.Fatalf("want the delegate serving the task, shims: %v", ps)
	}
	if ps := shimProcessesNamed(t, s, "containerd-shim-tidepool-v1"); len(ps) != 0 {
		t.Fatalf("the tidepool shim should have handed off and exited: %v", ps)
	}
	pid, _ := taskStatus(t, s, "dlg")
	if err := s.C.Restart(); err != nil {
		t.Fatal(err)
	}
	if p2, st := taskStatus(t, s, "dlg"); p2 != pid || st != "RUNNING" {
		t.Fatalf("after containerd restart: pid %s status %s, want %s RUNNING", p2, st, pid)
	}
	if got := s.MustCtr(t, "task", "exec", "--exec-id", "e1", "--fifo-dir", s.C.FIFODir, "dlg", "echo", "exec ok"); got != "exec ok\n" {
		t.Fatalf("exec after restart: %q", got)
	}
	s.MustCtr(t, "task", "kill", "-s", "KILL", "dlg")
	waitStatus(t, s, "dlg", "STOPPED")
	s.MustCtr(t, "task", "rm", "dlg")
	s.MustCtr(t, "container", "rm", "dlg")
	s.C.LeakCheck(t)
}

// TestShimBadInput: each mistake is a clear error at create, naming what was wrong,
// and leaves no container, snapshot binding, mount, shim or cgroup behind.
func TestShimBadInput(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	other := s.Ingest(t, writeTree(t, map[string]string{"other": "x"}))
	good := shimFlags(t, s, "")
	noDaemon := shimFlags(t, s, "") // same config but an API socket nobody serves
	noDaemon[3] = filepath.Join(t.TempDir(), "shim.toml")
	os.WriteFile(noDaemon[3], []byte(fmt.Sprintf("api_address = %q\n", filepath.Join(s.Dir, "nobody.sock"))), 0o644)
	cases := []struct {
		name  string
		flags []string
		want  []string
	}{
		{"unknown runtime", append(append([]string{}, good...), annotations(shim.AnnotationRuntime+"=bogus")...), []string{shim.AnnotationRuntime, "kata-fc, runc, runsc"}},
		{"malformed fork", append(append([]string{}, good...), annotations(binding.AnnotationFork+"="+strings.Repeat("q", 64))...), []string{binding.AnnotationFork, "malformed hash"}},
		{"unknown fork", append(append([]string{}, good...), annotations(binding.AnnotationFork+"=0123456789abcdef")...), []string{binding.AnnotationFork, "not found"}},
		{"escaping workdir", append(append([]string{}, good...), annotations(binding.AnnotationFork+"="+root, binding.AnnotationWorkdir+"=/app/../..")...), []string{binding.AnnotationWorkdir}},
		{"label conflict", append(append(append([]string{}, good...), "--snapshotter-label", binding.LabelFork+"="+root), annotations(binding.AnnotationFork+"="+other)...), []string{binding.AnnotationFork, "conflict"}},
		{"tidepoold unreachable", append(append([]string{}, noDaemon...), annotations(binding.AnnotationFork+"="+root)...), []string{binding.AnnotationFork, "cannot reach tidepoold"}},
	}
	for i, c := range cases {
		id := fmt.Sprintf("bad-%d", i)
		args := append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, c.flags...), imagebuild.BusyboxRef, id, "true")
		out, err := s.Ctr(args...)
		if err == nil {
			t.Errorf("%s: ctr run succeeded: %q", c.name, out)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error does not mention %q:\n%v", c.name, w, err)
			}
		}
		s.Ctr("container", "rm", id)
	}
	if ps, _ := harness.ShimProcesses(s.C.Address); len(ps) != 0 {
		t.Errorf("shims left: %v", ps)
	}
	// The only fork record is the one the conflicting label made; nothing else bound.
	for _, f := range s.Forks(t) {
		if f.Base.String() != root {
			t.Errorf("unexpected fork record %+v", f)
		}
	}
	s.C.LeakCheck(t)
}

// TestShimCrashAndContainerdRestart: with running containers, containerd restarts and
// reconnects to the tidepool shim; a shim killed with SIGKILL is cleaned up by
// containerd exactly as a dead runc shim is.
func TestShimCrashAndContainerdRestart(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	flags := append(shimFlags(t, s, ""), annotations(binding.AnnotationFork+"="+root, binding.AnnotationWorkdir+"=/app")...)
	for _, id := range []string{"survivor", "victim"} {
		s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, flags...), imagebuild.BusyboxRef, id, "sleep", "1000")...)
		waitStatus(t, s, id, "RUNNING")
	}
	pid, _ := taskStatus(t, s, "survivor")
	if err := s.C.Restart(); err != nil {
		t.Fatal(err)
	}
	if p2, st := taskStatus(t, s, "survivor"); p2 != pid || st != "RUNNING" {
		t.Fatalf("after containerd restart: %s %s, want %s RUNNING", p2, st, pid)
	}
	if got := s.MustCtr(t, "task", "exec", "--exec-id", "e1", "--fifo-dir", s.C.FIFODir, "survivor", "cat", "/app/README.md"); got != appSource["README.md"] {
		t.Fatalf("exec after restart: %q", got)
	}

	// Kill a shim with SIGKILL, ours and containerd's runc shim side by side: containerd
	// must clean up after both the same way (the task goes, the container stays and
	// can be removed).
	s.MustCtr(t, "run", "-d", "--fifo-dir", s.C.FIFODir, "--snapshotter", "tidepool", imagebuild.BusyboxRef, "runc-victim", "sleep", "1000")
	waitStatus(t, s, "runc-victim", "RUNNING")
	after := map[string]string{}
	for id, shimName := range map[string]string{"victim": "containerd-shim-tidepool-v1", "runc-victim": "containerd-shim-runc-v2"} {
		var shimPid int
		for _, p := range shimProcessesNamed(t, s, shimName) {
			if strings.Contains(strings.Join(p.Cmdline, " "), "-id "+id) {
				shimPid = p.Pid
			}
		}
		if shimPid == 0 {
			t.Fatalf("%s's shim not found", id)
		}
		if err := syscall.Kill(shimPid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			if _, st := taskStatus(t, s, id); st != "RUNNING" || time.Now().After(deadline) {
				after[id] = st
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if after["victim"] != after["runc-victim"] || after["victim"] == "RUNNING" {
		t.Fatalf("after SIGKILL of the shim: tidepool task %q, runc task %q", after["victim"], after["runc-victim"])
	}
	for _, id := range []string{"victim", "runc-victim"} {
		s.Ctr("task", "rm", id)
		s.MustCtr(t, "container", "rm", id)
	}
	s.MustCtr(t, "task", "kill", "-s", "KILL", "survivor")
	waitStatus(t, s, "survivor", "STOPPED")
	s.MustCtr(t, "task", "rm", "survivor")
	s.MustCtr(t, "container", "rm", "survivor")
	s.C.LeakCheck(t)
}

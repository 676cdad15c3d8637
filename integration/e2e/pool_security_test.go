package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/pool"
)

// hijackEnv makes this test binary, copied where another user can run it, act as an
// unprivileged local user trying to take over a warm member's control socket.
const hijackEnv = "TIDEPOOL_E2E_HIJACK_MEMBER_DIR"

func init() {
	if dir := os.Getenv(hijackEnv); dir != "" {
		os.Exit(hijack(dir))
	}
}

// hijack does what the audit's attacker did: move the holder's socket aside, bind
// one of its own in its place, and wait for tidepoold to hand it a workload. It prints
// "denied: ..." when the filesystem stops it, "listening" once it waits, and "GOT ..."
// with whatever it receives.
func hijack(dir string) int {
	sock := filepath.Join(dir, "ctl.sock")
	if err := os.Rename(sock, sock+".old"); err != nil {
		fmt.Println("denied:", err)
		return 0
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		fmt.Println("denied:", err)
		return 0
	}
	os.Chmod(sock, 0o777)
	fmt.Println("listening")
	l.SetDeadline(time.Now().Add(60 * time.Second))
	c, err := l.AcceptUnix()
	if err != nil {
		fmt.Println("no connection:", err)
		return 0
	}
	buf, oob := make([]byte, 1<<20), make([]byte, 1024)
	n, oobn, _, _, _ := c.ReadMsgUnix(buf, oob)
	fmt.Printf("GOT %d bytes, %d bytes of descriptors: %q\n", n, oobn, buf[:n])
	return 0
}

// memberIDs lists the pool's members by their control directories.
func memberIDs(t *testing.T, s *stack.Stack) []string {
	t.Helper()
	var ids []string
	for _, id := range strings.Fields(s.MustCtr(t, "container", "ls", "-q")) {
		if strings.HasPrefix(id, pool.MemberIDPrefix+"node-") {
			ids = append(ids, id)
		}
	}
	return ids
}

// asNobody copies this test binary where uid 65534 may run it and starts it as that
// user against a member's control directory.
func asNobody(t *testing.T, s *stack.Stack, memberDir string) (*exec.Cmd, *bufio.Reader) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(s.Dir, "attacker")
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{hijackEnv + "=" + memberDir}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, bufio.NewReader(out)
}

// TestPoolMemberHijack: a local user who is not root tries to take over a real warm
// member's control socket (the member id is public: it is on the shim's command line)
// to receive the next workload's argv, environment and stdio. The filesystem stops
// it, the claim runs the real workload with its secret, and the attacker receives
// nothing. Then a listener that is not the member's holder (root replacing the socket,
// as a stale process could) gets nothing either: tidepoold checks SO_PEERCRED first.
func TestPoolMemberHijack(t *testing.T) {
	s := poolStack(t, 1, "")
	waitPool(t, s, "node", 1)
	// A real root sits in a directory everyone may traverse (/var/lib); so does this
	// one, for the test to mean something.
	for _, d := range []string{s.Dir, s.Root} { // both made by the stack; /tmp above is traversable
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ids := memberIDs(t, s)
	if len(ids) != 1 {
		t.Fatalf("members %v", ids)
	}
	memberDir := filepath.Join(s.Root, "pools", ids[0])
	for _, p := range []string{filepath.Join(s.Root, "pools"), memberDir, filepath.Join(memberDir, "ctl.sock")} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s is %v: open to other users", p, st.Mode().Perm())
		}
	}

	cmd, out := asNobody(t, s, memberDir)
	first, _ := out.ReadString('\n')
	t.Logf("attacker: %s", strings.TrimSpace(first))

	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	claim := exec.CommandContext(ctx, filepath.Join(s.Bin, "tidepool"), "--root", s.Root, "run", "--pool", "node",
		"--env", "API_TOKEN=s3cret", "--", "sh", "-c", "echo real-$API_TOKEN")
	got, err := claim.CombinedOutput()
	cmd.Process.Kill()
	rest, _ := io.ReadAll(out)
	cmd.Wait()
	attacker := first + string(rest)
	if strings.Contains(attacker, "GOT") || strings.Contains(attacker, "s3cret") {
		t.Errorf("the unprivileged user received the workload: %s", attacker)
	}
	if !strings.HasPrefix(attacker, "denied:") {
		t.Errorf("the unprivileged user was not stopped by the filesystem: %s", attacker)
	}
	if err != nil || string(got) != "real-s3cret\n" {
		t.Fatalf("claim: %v, output %q\n%s", err, got, s.Daemon.LogTail(30))
	}

	// A listener that is not the member's holder: root moves the socket aside and binds
	// its own (what a process left from an earlier holder, or anyone who got at the
	// directory, could do). tidepoold must check who listens before sending.
	waitPool(t, s, "node", 1)
	var sock string
	waitFor(t, "one member left", func() string {
		if ids = memberIDs(t, s); len(ids) != 1 {
			return fmt.Sprintf("members %v", ids)
		}
		return ""
	})
	sock = filepath.Join(s.Root, "pools", ids[0], "ctl.sock")
	if err := os.Rename(sock, sock+".old"); err != nil {
		t.Fatal(err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	received := make(chan string, 1)
	go func() {
		c, err := l.AcceptUnix()
		if err != nil {
			received <- ""
			return
		}
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		b, _ := io.ReadAll(c)
		received <- string(b)
	}()
	out2, errOut, code := tidepoolRun(t, s, "", "--pool", "node", "--env", "API_TOKEN=s3cret", "--", "sh", "-c", "echo real-$API_TOKEN")
	if code == 0 || !strings.Contains(errOut, "refusing to hand the workload") {
		t.Errorf("claim against a foreign listener %s: exit %d, stdout %q, stderr %q\n%s", sock, code, out2, errOut, s.Daemon.LogTail(40))
	}
	l.Close()
	if r := <-received; r != "" {
		t.Errorf("a foreign listener received %q", r)
	}
	// The pool refills and the next claim is the real workload.
	waitPool(t, s, "node", 1)
	if out, e, code := tidepoolRun(t, s, "", "--pool", "node", "--", "echo", "ok"); code != 0 || out != "ok\n" {
		t.Fatalf("claim after the refused one: exit %d, %q %q", code, out, e)
	}
}

// TestPoolClaimKeepsLimits: a container that asks for a memory limit and adopts a warm
// member runs with that limit, in its own cgroup (the path containerd gave it), not in
// the member's; pause, kill and delete reach it there, and its cgroup goes with it.
func TestPoolClaimKeepsLimits(t *testing.T) {
	s := poolStack(t, 1, "")
	waitPool(t, s, "node", 1)
	flags := append(shimFlags(t, s, ""), annotations("dev.tidepool.pool=node")...)
	const limit = 67108864
	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir, "--memory-limit", strconv.Itoa(limit)}, flags...),
		imagebuild.NodeRef, "lim1", "sleep", "1000")...)
	waitStatus(t, s, "lim1", "RUNNING")
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		// cgroup v2 only: claims cannot move members yet, so the container starts cold,
		// with the limit runc gives it, and that is counted.
		if n := s.Metric(t, "tidepool_pool_cold_fallbacks_total", `pool="node"`, `reason="cgroup_v2"`); n != 1 {
			t.Fatalf("cold fallbacks for cgroup_v2: %v, want 1", n)
		}
		s.MustCtr(t, "task", "kill", "-s", "KILL", "lim1")
		return
	}
	if n := s.Metric(t, "tidepool_pool_claim_seconds_count", `pool="node"`); n != 1 {
		t.Fatalf("%v warm claims, want 1 (the container started cold)", n)
	}
	pid, _ := taskStatus(t, s, "lim1")
	want := "/" + s.C.Namespace + "/lim1"
	cg, err := os.ReadFile("/proc/" + pid + "/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		f := strings.SplitN(line, ":", 3)
		for _, ctl := range []string{"memory", "pids", "freezer", "cpu,cpuacct", "cpu", "devices"} {
			if f[1] == ctl && f[2] != want {
				t.Errorf("workload's %s cgroup is %s, want %s", ctl, f[2], want)
			}
		}
	}
	lim, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", want, "memory.limit_in_bytes"))
	if err != nil || strings.TrimSpace(string(lim)) != strconv.Itoa(limit) {
		t.Fatalf("memory.limit_in_bytes of %s: %q %v", want, lim, err)
	}
	// Pause freezes the workload where it now lives.
	s.MustCtr(t, "task", "pause", "lim1")
	if st, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/freezer", want, "freezer.state")); strings.TrimSpace(string(st)) != "FROZEN" {
		t.Errorf("paused workload's freezer is %q", st)
	}
	s.MustCtr(t, "task", "resume", "lim1")
	s.MustCtr(t, "task", "kill", "-s", "KILL", "lim1")
	waitStatus(t, s, "lim1", "STOPPED")
	s.MustCtr(t, "task", "rm", "lim1")
	s.MustCtr(t, "container", "rm", "lim1")
	waitFor(t, "the container's cgroup removed", func() string {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup/memory", want)); err == nil {
			return want + " still exists"
		}
		return ""
	})

}

package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
)

// writeTree writes files (path -> content) under a new temp dir.
func writeTree(t testing.TB, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for p, c := range files {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// appSource is a real (small) Node program: it needs lodash, which only the image
// has (baked in /app/node_modules), and ./greet, which only the fork has.
var appSource = map[string]string{
	"README.md":    "# app\n",
	"src/main.js":  "const _ = require('lodash');\nconst greet = require('./greet');\nconsole.log(greet(_.capitalize('tidepool')));\n",
	"src/greet.js": "module.exports = (who) => 'hello ' + who;\n",
	"src/old.js":   "// about to be deleted\n",
}

func forkLabels(root, workdir string, extra ...string) []string {
	args := []string{"--snapshotter", "tidepool",
		"--snapshotter-label", binding.LabelFork + "=" + root,
		"--snapshotter-label", binding.LabelWorkdir + "=" + workdir}
	for _, kv := range extra {
		args = append(args, "--snapshotter-label", kv)
	}
	return args
}

func runRm(t testing.TB, s *stack.Stack, id string, flags []string, image string, cmd ...string) string {
	t.Helper()
	args := append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, flags...)
	return s.MustCtr(t, append(append(args, image, id), cmd...)...)
}

// forkOfContainer finds the fork record the snapshotter made for a container's
// snapshot (a fork given as a bare root is labelled with the snapshot key), once its
// root differs from base.
func forkOfContainer(t testing.TB, s *stack.Stack, id, base string) forks.Fork {
	t.Helper()
	return s.WaitFork(t, "for container "+id, func(f forks.Fork) bool {
		return strings.HasSuffix(f.Label, "/"+id) && f.Root.String() != base
	})
}

func TestForkInContainer(t *testing.T) {
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, node.Path, imagebuild.NodeRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))

	script := strings.Join([]string{
		"node /app/src/main.js",
		"test -f /app/node_modules/lodash/package.json",
		"test -f /app/package.json",
		"stat -c '%u:%g' /app/src/main.js",
		"echo new > /app/new.txt",
		"rm /app/src/old.js",
		"echo more >> /app/README.md",
		"echo outside > /etc/outside-workdir",
	}, " && ")
	out := runRm(t, s, "fork1", forkLabels(root, "/app", binding.LabelOwner+"=1000:1000"), imagebuild.NodeRef, "sh", "-c", script)
	if out != "hello Tidepool\n1000:1000\n" {
		t.Fatalf("container printed %q", out)
	}

	f := forkOfContainer(t, s, "fork1", root)
	diff := s.MustTidepool(t, "diff", root, f.ID)
	if want := "M README.md\nA new.txt\nD src/old.js\n"; diff != want {
		t.Fatalf("fork changes:\n%s\nwant:\n%s", diff, want)
	}
	if got := s.MustTidepool(t, "cat", f.ID, "new.txt"); got != "new\n" {
		t.Fatalf("new.txt on the fork: %q", got)
	}

	// The image's layers are untouched: a container without a fork sees the image's
	// /app as it was built, and nothing the first container wrote.
	out = runRm(t, s, "plain", []string{"--snapshotter", "tidepool"}, imagebuild.NodeRef,
		"sh", "-c", "ls /app; test ! -e /etc/outside-workdir && echo clean")
	if out != "index.js\nnode_modules\npackage-lock.json\npackage.json\nclean\n" {
		t.Fatalf("image /app after the fork container: %q", out)
	}
	s.C.LeakCheck(t)
}

// TestWithoutForkIsOverlayfs: images run unchanged; snapshots, mounts and usage look
// as they do with containerd's overlayfs snapshotter.
func TestWithoutForkIsOverlayfs(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool", "overlayfs")
	script := "echo hi > /tmp/x && cat /tmp/x && ls / | tr '\\n' ' '"
	a := runRm(t, s, "tp", []string{"--snapshotter", "tidepool"}, imagebuild.BusyboxRef, "sh", "-c", script)
	b := runRm(t, s, "ov", []string{"--snapshotter", "overlayfs"}, imagebuild.BusyboxRef, "sh", "-c", script)
	if a != b {
		t.Fatalf("tidepool:  %q\noverlayfs: %q", a, b)
	}
	s.MustCtr(t, "run", "-d", "--fifo-dir", s.C.FIFODir, "--snapshotter", "tidepool", imagebuild.BusyboxRef, "sleeper", "sleep", "1000")
	mounts := s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "mounts", "/tmp/x", "sleeper")
	if !strings.Contains(mounts, "overlay") || strings.Contains(mounts, "/views/") {
		t.Fatalf("mounts of a fork-less snapshot: %s", mounts)
	}
	s.MustCtr(t, "task", "rm", "-f", "sleeper")
	s.MustCtr(t, "container", "rm", "sleeper")
	s.C.LeakCheck(t)
}

func TestBadLabelsFailCleanly(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	cases := map[string]struct {
		labels []string
		key    string
	}{
		"malformed": {[]string{binding.LabelFork + "=" + strings.Repeat("x", 64)}, binding.LabelFork},
		"unknown":   {[]string{binding.LabelFork + "=0123456789abcdef"}, binding.LabelFork},
		"relative":  {[]string{binding.LabelFork + "=" + root, binding.LabelWorkdir + "=app"}, binding.LabelWorkdir},
		"escaping":  {[]string{binding.LabelFork + "=" + root, binding.LabelWorkdir + "=/app/../.."}, binding.LabelWorkdir},
		"owner":     {[]string{binding.LabelFork + "=" + root, binding.LabelOwner + "=root"}, binding.LabelOwner},
	}
	for name, c := range cases {
		var flags []string
		for _, l := range c.labels {
			flags = append(flags, "--snapshotter-label", l)
		}
		args := append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir, "--snapshotter", "tidepool"}, flags...)
		out, err := s.Ctr(append(args, imagebuild.BusyboxRef, "bad-"+name, "true")...)
		if err == nil || !strings.Contains(err.Error(), c.key) {
			t.Errorf("%s: ctr run gave %q, %v; want an error naming %s", name, out, err, c.key)
		}
		s.Ctr("container", "rm", "bad-"+name)
	}
	// Nothing left: no active snapshot, no view, no fork record.
	snaps := s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "ls")
	if strings.Contains(snaps, "Active") {
		t.Errorf("active snapshots left:\n%s", snaps)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Root, "views")); len(ents) != 0 {
		t.Errorf("view mountpoints left: %v", ents)
	}
	if left, _ := harness.MountsUnder(s.Root); len(left) != 0 {
		t.Errorf("mounts left: %v", left)
	}
	if fs := s.Forks(t); len(fs) != 0 {
		t.Errorf("fork records left: %+v", fs)
	}
	s.C.LeakCheck(t)
}

// TestManyContainersOneRoot: 20 containers on one root at once each see only their
// own writes, and leave 20 new roots.
func TestManyContainersOneRoot(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	const n = 20
	var wg sync.WaitGroup
	outs := make([]string, n)
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			id := fmt.Sprintf("many-%02d", i)
			args := append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/app")...)
			// The container checks what it sees itself and says so by its exit
			// status: under this load ctr can lose a short-lived task's last output
			// (the FIFO copy races the exit), so stdout only explains a failure.
			script := fmt.Sprintf(`echo %d > /app/mine-%02d && sleep 1 && seen=$(ls /app | grep mine-); echo "$seen"; [ "$seen" = mine-%02d ]`, i, i, i)
			outs[i], errs[i] = s.Ctr(append(args, imagebuild.BusyboxRef, id, "sh", "-c", script)...)
		}(i)
	}
	wg.Wait()
	for i := 0; i < n; i++ {
		if errs[i] != nil {
			t.Fatalf("container %d did not see only its own mine-%02d: %v (output %q)", i, i, errs[i], outs[i])
		}
	}
	roots := map[string]bool{}
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("many-%02d", i)
		f := forkOfContainer(t, s, id, root)
		if d := s.MustTidepool(t, "diff", root, f.Root.String()); d != fmt.Sprintf("A mine-%02d\n", i) {
			t.Errorf("%s: fork diff %q", id, d)
		}
		roots[f.Root.String()] = true
	}
	if len(roots) != n {
		t.Errorf("%d distinct new roots, want %d", len(roots), n)
	}
	s.C.LeakCheck(t)
}

// TestDaemonRestart: tidepoold restarts while no container runs; images and committed
// snapshots are intact and containers start again, forks included.
func TestDaemonRestart(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	before := s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "ls")
	// A container that exists (snapshot prepared, view mounted) but does not run.
	s.MustCtr(t, append(append([]string{"container", "create"}, forkLabels(root, "/app")...), imagebuild.BusyboxRef, "idle", "cat", "/app/README.md")...)

	s.RestartDaemon(t)

	after := s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "ls")
	for _, line := range strings.Split(strings.TrimSpace(before), "\n")[1:] {
		if f := strings.Fields(line); !strings.Contains(after, f[0]) || !strings.Contains(after, f[len(f)-1]) {
			t.Errorf("snapshot %q gone after restart:\n%s", line, after)
		}
	}
	out := runRm(t, s, "again", forkLabels(root, "/app"), imagebuild.BusyboxRef, "cat", "/app/README.md")
	if out != appSource["README.md"] {
		t.Fatalf("after restart: %q", out)
	}
	// The idle container's view is served again by the new daemon.
	s.MustCtr(t, "task", "start", "--fifo-dir", s.C.FIFODir, "idle")
	s.MustCtr(t, "container", "rm", "idle")
	names := []string{}
	for _, f := range s.Forks(t) {
		names = append(names, f.Label)
	}
	sort.Strings(names)
	if len(names) != 2 {
		t.Errorf("forks after restart: %v", names)
	}
	s.C.LeakCheck(t)
}

// TestReadyMeansContainerdReaches: tidepoold crashed (its socket file left behind), and
// containerd called it meanwhile, so containerd's connection to the snapshotter waits
// out a reconnect backoff (1 s, growing to 3 s; calls in it fail at once) when
// tidepoold comes back. tidepoold says it is ready (systemd's READY=1, which the stack
// waits for) only once containerd reaches it again: the first `ctr` commands after
// the restart work, with no retry.
func TestReadyMeansContainerdReaches(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	runRm(t, s, "before", []string{"--snapshotter", "tidepool"}, imagebuild.BusyboxRef, "true")
	for i := range 2 {
		if err := s.Daemon.Kill(); err != nil {
			t.Fatal(err)
		}
		// Every dial finds the dead socket (refused at once): the connection spends
		// the downtime in backoff, which has grown past a second by the end.
		for deadline := time.Now().Add(4 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if _, err := s.Ctr("snapshot", "--snapshotter", "tidepool", "ls"); err == nil {
				t.Fatal("containerd listed tidepool's snapshots while tidepoold was down")
			}
		}
		start := time.Now()
		if err := s.Daemon.Start(context.Background()); err != nil {
			t.Fatalf("start tidepoold: %v", err)
		}
		t.Logf("restart %d: tidepoold ready in %v", i, time.Since(start).Round(time.Millisecond))
		if out, err := s.Ctr("snapshot", "--snapshotter", "tidepool", "ls"); err != nil {
			t.Fatalf("restart %d: containerd cannot reach tidepoold once it is ready: %v\n%s", i, err, out)
		}
		runRm(t, s, fmt.Sprintf("after-%d", i), []string{"--snapshotter", "tidepool"}, imagebuild.BusyboxRef, "true")
	}
	s.C.LeakCheck(t)
}

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/fuse"
	"github.com/tidepool-dev/tidepool/kview"
)

func TestParseOwner(t *testing.T) {
	good := map[string][2]uint32{"0:0": {0, 0}, "1000:1000": {1000, 1000}, "1:2": {1, 2}, "4294967294:7": {4294967294, 7}}
	for s, want := range good {
		u, g, err := parseOwner(s)
		if err != nil || u != want[0] || g != want[1] {
			t.Errorf("parseOwner(%q) = %d, %d, %v", s, u, g, err)
		}
	}
	for _, s := range []string{"", "1000", "1000:", ":1000", "a:b", "-1:0", "+1:0", " 1:1", "1:1 ", "1:2:3", "4294967295:0", "4294967296:0", "0x10:0", "1_000:0"} {
		if _, _, err := parseOwner(s); err == nil || !strings.Contains(err.Error(), "invalid --owner") {
			t.Errorf("parseOwner(%q) = %v, want invalid --owner", s, err)
		}
	}
}

// cliEnv is a Tidepool root with a small tree and a fork "demo" of it, and a
// freshly built tidepool binary.
type cliEnv struct {
	bin, root string
	tree      casstore.Hash
}

func newCLIEnv(t *testing.T) *cliEnv {
	t.Helper()
	if testing.Short() {
		t.Skip("builds tidepool and mounts FUSE views: skipped with -short")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts FUSE views")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("needs /dev/fuse: %v", err)
	}
	e := &cliEnv{bin: filepath.Join(t.TempDir(), "tidepool"), root: t.TempDir()}
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", e.bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build tidepool: %v\n%s", err, out)
	}
	s, err := casstore.Open(filepath.Join(e.root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	hello, err := s.PutBytes([]byte("hello\n"))
	if err != nil {
		t.Fatal(err)
	}
	script, err := s.PutBytes([]byte("#!/bin/sh\necho hi\n"))
	if err != nil {
		t.Fatal(err)
	}
	if e.tree, err = s.WriteTree([]casstore.Entry{
		{Mode: casstore.ModeFile, Name: "hello.txt", Hash: hello},
		{Mode: casstore.ModeExec, Name: "run.sh", Hash: script},
	}); err != nil {
		t.Fatal(err)
	}
	db, err := forks.OpenDB(filepath.Join(e.root, "forks.db"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Create(context.Background(), forks.CreateRequest{Base: e.tree, Label: "demo"}); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *cliEnv) command(args ...string) *exec.Cmd {
	return exec.Command(e.bin, append([]string{"--root", e.root}, args...)...)
}

// run runs the CLI to completion.
func (e *cliEnv) run(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := e.command(args...)
	var o, se bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &se
	err = cmd.Run()
	return o.String(), se.String(), err
}

// start starts a foreground mount and waits until the view is in the mount table.
func (e *cliEnv) start(t *testing.T, dir string, args ...string) *exec.Cmd {
	t.Helper()
	if !slices.Contains(args, "--mode") {
		args = append([]string{"--mode", "fuse"}, args...) // a foreground FUSE server
	}
	cmd := e.command(append([]string{"mount"}, append(args, dir)...)...)
	var se bytes.Buffer
	cmd.Stderr = &se
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		// A server killed while a file of its own view is open cannot finish
		// exiting: closing that file sends the view a FLUSH only the dead server
		// could answer. If it hangs, abort the view's FUSE connection.
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Logf("mount server of %s stuck exiting; aborting its FUSE connection: %v", dir, abortFUSE(dir))
			<-done
		}
		fuse.UnmountStale(dir)
	})
	deadline := time.Now().Add(20 * time.Second)
	for !isView(t, dir) {
		if time.Now().After(deadline) {
			t.Fatalf("view did not appear at %s; stderr: %s", dir, se.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cmd
}

// stop ends a foreground mount that start started and returns what it wrote to
// stderr; the view at dir is gone afterwards.
func (e *cliEnv) stop(t *testing.T, cmd *exec.Cmd, dir string) string {
	t.Helper()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	cmd.Wait() // the exit status of a signalled server says nothing here
	fuse.UnmountStale(dir)
	return cmd.Stderr.(*bytes.Buffer).String()
}

// abortFUSE aborts the FUSE connection of the view mounted at dir, through the fusectl
// filesystem (mounted at /sys/fs/fuse/connections first if it is not).
func abortFUSE(dir string) error {
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil || len(ms) == 0 {
		return fmt.Errorf("no mount at %s: %v", dir, err)
	}
	const ctl = "/sys/fs/fuse/connections"
	conn := filepath.Join(ctl, strconv.Itoa(ms[len(ms)-1].Minor))
	if _, err := os.Stat(conn); err != nil {
		if err := unix.Mount("none", ctl, "fusectl", 0, ""); err != nil {
			return fmt.Errorf("mount fusectl: %w", err)
		}
	}
	return os.WriteFile(filepath.Join(conn, "abort"), []byte("1"), 0)
}

func isView(t *testing.T, dir string) bool {
	t.Helper()
	ms, err := fuse.Mounts(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m == dir {
			return true
		}
	}
	return false
}

// exited waits for a started command and returns its error.
func exited(t *testing.T, cmd *exec.Cmd) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("mount process did not exit")
		return nil
	}
}

// gone reports whether pid no longer runs (a zombie counts as gone).
func gone(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	return len(f) > 0 && (f[0] == "Z" || f[0] == "X")
}

func TestMountCommand(t *testing.T) {
	e := newCLIEnv(t)

	t.Run("foreground fork with prefix and owner, stopped by SIGINT", func(t *testing.T) {
		dir := t.TempDir()
		cmd := e.start(t, dir, "--prefix", "app", "--owner", "1000:1001", "demo")
		b, err := os.ReadFile(filepath.Join(dir, "app/hello.txt"))
		if err != nil || string(b) != "hello\n" {
			t.Fatalf("read through the view: %q %v", b, err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(dir, "app/run.sh"), &st); err != nil || st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o777 != 0o755 {
			t.Errorf("run.sh: uid %d gid %d mode %o (%v)", st.Uid, st.Gid, st.Mode, err)
		}
		// The fork database is not held while the view is mounted.
		db, err := forks.OpenDB(filepath.Join(e.root, "forks.db"), time.Second)
		if err != nil {
			t.Errorf("fork database locked by a running mount: %v", err)
		} else {
			db.Close()
		}
		cmd.Process.Signal(os.Interrupt)
		if err := exited(t, cmd); err != nil {
			t.Errorf("exit after SIGINT: %v", err)
		}
		if isView(t, dir) {
			t.Error("view still mounted after SIGINT")
		}
	})

	t.Run("umount ends a foreground mount", func(t *testing.T) {
		dir := t.TempDir()
		cmd := e.start(t, dir, e.tree.String())
		f, err := os.Open(filepath.Join(dir, "hello.txt"))
		if err != nil {
			t.Fatal(err)
		}
		_, stderr, err := e.run(t, "umount", dir)
		if err == nil || !strings.Contains(stderr, "--lazy") {
			t.Errorf("umount of a busy view: %v, stderr %q", err, stderr)
		}
		f.Close()
		if _, stderr, err := e.run(t, "umount", dir); err != nil {
			t.Fatalf("umount: %v: %s", err, stderr)
		}
		if err := exited(t, cmd); err != nil {
			t.Errorf("mount process after umount: %v", err)
		}
		if _, stderr, err := e.run(t, "umount", dir); err == nil || !strings.Contains(stderr, "no tidepool view") {
			t.Errorf("umount of a plain dir: %v %q", err, stderr)
		}
	})

	t.Run("daemon", func(t *testing.T) {
		dir := t.TempDir()
		logFile := filepath.Join(t.TempDir(), "mount.log")
		stdout, stderr, err := e.run(t, "--log-level", "info", "mount", "--daemon", "--log-file", logFile, e.tree.String(), dir)
		if err != nil {
			t.Fatalf("mount --daemon: %v: %s", err, stderr)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(stdout))
		if err != nil {
			t.Fatalf("stdout %q is not a pid", stdout)
		}
		t.Cleanup(func() {
			syscall.Kill(pid, syscall.SIGKILL)
			fuse.UnmountStale(dir)
		})
		// Ready means mounted: no polling needed.
		if b, err := os.ReadFile(filepath.Join(dir, "hello.txt")); err != nil || string(b) != "hello\n" {
			t.Fatalf("read right after mount --daemon: %q %v", b, err)
		}
		if gone(pid) {
			t.Fatal("daemon is not running")
		}
		if _, stderr, err := e.run(t, "umount", dir); err != nil {
			t.Fatalf("umount: %v: %s", err, stderr)
		}
		deadline := time.Now().Add(20 * time.Second)
		for !gone(pid) {
			if time.Now().After(deadline) {
				t.Fatal("daemon still running after umount")
			}
			time.Sleep(10 * time.Millisecond)
		}
		if b, _ := os.ReadFile(logFile); !strings.Contains(string(b), "view mounted") {
			t.Errorf("daemon log: %q", b)
		}
	})

	t.Run("daemon that cannot mount reports why", func(t *testing.T) {
		dir := t.TempDir()
		missing := casstore.Sum([]byte("nothing"))
		stdout, stderr, err := e.run(t, "mount", "--daemon", missing.String(), dir)
		if err == nil || stdout != "" || !strings.Contains(stderr, "not in the store") || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
			t.Errorf("mount --daemon of a missing root: %v, stdout %q, stderr %q", err, stdout, stderr)
		}
		if isView(t, dir) {
			t.Error("failed daemon left a mount")
		}
	})

	t.Run("bad arguments", func(t *testing.T) {
		dir := t.TempDir()
		for _, args := range [][]string{
			{"mount", "--owner", "1000", e.tree.String(), dir},
			{"mount", "--owner", "x:1", "--daemon", e.tree.String(), dir},
			{"mount", "--prefix", "../up", e.tree.String(), dir},
			{"mount", "no-such-fork", dir},
		} {
			_, stderr, err := e.run(t, args...)
			if err == nil || !strings.HasPrefix(stderr, "tidepool: ") {
				t.Errorf("%q: %v, stderr %q", args, err, stderr)
			}
		}
		if isView(t, dir) {
			t.Error("a refused mount left a mount")
		}
	})

	t.Run("umount --lazy clears a dead view", func(t *testing.T) {
		dir := t.TempDir()
		stdout, stderr, err := e.run(t, "mount", "--daemon", e.tree.String(), dir)
		if err != nil {
			t.Fatalf("mount --daemon: %v: %s", err, stderr)
		}
		pid, _ := strconv.Atoi(strings.TrimSpace(stdout))
		t.Cleanup(func() { fuse.UnmountStale(dir) })
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			_, err := os.Stat(dir)
			if errors.Is(err, syscall.ENOTCONN) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("view did not die: %v", err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		if _, stderr, err := e.run(t, "umount", "--lazy", dir); err != nil {
			t.Fatalf("umount --lazy: %v: %s", err, stderr)
		}
		if isView(t, dir) {
			t.Error("dead view still mounted")
		}
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("mountpoint unusable after cleanup: %v", err)
		}
	})
}

// TestMountKernelMode: --mode kernel mounts a view that needs no process and returns;
// umount removes it and its cached image; auto falls back to FUSE for a tree whose
// objects are not all local, and kernel mode refuses it naming the object.
func TestMountKernelMode(t *testing.T) {
	e := newCLIEnv(t)
	if err := kview.Probe(t.TempDir()); err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	if _, stderr, err := e.run(t, "mount", "--mode", "kernel", "--prefix", "app", "--owner", "1000:1001", "demo", dir); err != nil {
		t.Fatalf("mount --mode kernel: %v: %s", err, stderr)
	}
	if !kview.IsMounted(dir) {
		t.Fatal("no kernel view mounted")
	}
	b, err := os.ReadFile(filepath.Join(dir, "app/hello.txt"))
	if err != nil || string(b) != "hello\n" {
		t.Fatalf("read through the kernel view: %q %v", b, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(dir, "app/run.sh"), &st); err != nil || st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o777 != 0o755 {
		t.Errorf("run.sh: uid %d gid %d mode %o (%v)", st.Uid, st.Gid, st.Mode, err)
	}
	images := filepath.Join(e.root, "kview", "images")
	if ents, _ := os.ReadDir(images); len(ents) == 0 {
		t.Error("no cached image while the view is mounted")
	}
	if _, stderr, err := e.run(t, "umount", dir); err != nil {
		t.Fatalf("umount: %v: %s", err, stderr)
	}
	if kview.IsMounted(dir) {
		t.Fatal("kernel view still mounted after umount")
	}
	// The image stays cached for the next mount of the tree (kview.DefaultGrace).
	if ents, _ := os.ReadDir(images); len(ents) == 0 {
		t.Errorf("image not kept for the next mount after umount")
	}

	// GC keeps the objects of a mounted kernel view of a root no fork names.
	s0, err := casstore.Open(filepath.Join(e.root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	lone, _ := s0.PutBytes([]byte("only in a kernel view\n"))
	loneTree, err := s0.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "lone.txt", Hash: lone}})
	if err != nil {
		t.Fatal(err)
	}
	if _, stderr, err := e.run(t, "mount", "--mode", "kernel", loneTree.String(), dir); err != nil {
		t.Fatalf("mount --mode kernel: %v: %s", err, stderr)
	}
	if _, stderr, err := e.run(t, "gc", "--grace", "0"); err != nil {
		t.Fatalf("gc: %v: %s", err, stderr)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "lone.txt")); err != nil || string(b) != "only in a kernel view\n" {
		t.Fatalf("kernel view after gc: %q %v", b, err)
	}
	if _, stderr, err := e.run(t, "umount", dir); err != nil {
		t.Fatalf("umount: %v: %s", err, stderr)
	}

	// A tree with an object missing from the store.
	s, err := casstore.Open(filepath.Join(e.root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	gone := casstore.Sum([]byte("gone\n"))
	keep, _ := s.PutBytes([]byte("kept\n"))
	partial, err := s.WriteTree([]casstore.Entry{
		{Mode: casstore.ModeFile, Name: "gone.txt", Hash: gone},
		{Mode: casstore.ModeFile, Name: "kept.txt", Hash: keep},
	})
	if err != nil {
		t.Fatal(err)
	}
	_, stderr, err := e.run(t, "mount", "--mode", "kernel", partial.String(), dir)
	if err == nil || !strings.Contains(stderr, gone.String()) || kview.IsMounted(dir) {
		t.Fatalf("kernel mount of a tree with a missing object: %v, stderr %q", err, stderr)
	}
	cmd := e.start(t, dir, "--mode", "auto", partial.String())
	if kview.IsMounted(dir) || !isView(t, dir) {
		t.Fatal("auto mounted a kernel view of a tree whose objects are not all local")
	}
	if b, err := os.ReadFile(filepath.Join(dir, "kept.txt")); err != nil || string(b) != "kept\n" {
		t.Fatalf("auto's FUSE view: %q %v", b, err)
	}
	// Objects not all local is what auto is for: no warning.
	if stderr := e.stop(t, cmd, dir); strings.Contains(stderr, "level=warning") {
		t.Errorf("auto warned about a tree whose objects are not all local:\n%s", stderr)
	}

	// A kernel view that fails for another reason (here a corrupt tree object; a full
	// disk is another): auto still serves FUSE, and warns, naming the cause.
	sub, err := s.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "f", Hash: keep}})
	if err != nil {
		t.Fatal(err)
	}
	rotten, err := s.WriteTree([]casstore.Entry{
		{Mode: casstore.ModeFile, Name: "kept.txt", Hash: keep},
		{Mode: casstore.ModeDir, Name: "sub", Hash: sub},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(s.Path(sub), []byte("rotten bytes"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd = e.start(t, dir, "--mode", "auto", rotten.String())
	if kview.IsMounted(dir) || !isView(t, dir) {
		t.Fatal("auto mounted a kernel view of a tree with a corrupt tree object")
	}
	if b, err := os.ReadFile(filepath.Join(dir, "kept.txt")); err != nil || string(b) != "kept\n" {
		t.Fatalf("auto's FUSE view: %q %v", b, err)
	}
	if stderr := e.stop(t, cmd, dir); !strings.Contains(stderr, "level=warning") || !strings.Contains(stderr, "kernel view failed") || !strings.Contains(stderr, sub.String()) {
		t.Errorf("auto served FUSE for a corrupt tree without a warning naming the object %s:\n%s", sub, stderr)
	}
}

// TestMountKernelModeRelativeDir: DIR given relative to the working directory and
// through a symbolic link names the same view as its real path: a second mount there
// is refused rather than stacked, and umount finds the view. A DIR that is a file is
// refused as one.
func TestMountKernelModeRelativeDir(t *testing.T) {
	e := newCLIEnv(t)
	if err := kview.Probe(t.TempDir()); err != nil {
		t.Skip(err)
	}
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(base, "real", "view")
	if err := os.MkdirAll(real, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("real", filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for range 4 { // the bug this catches stacks views
			if syscall.Unmount(real, syscall.MNT_DETACH) != nil {
				return
			}
		}
	})
	run := func(args ...string) (string, error) {
		cmd := e.command(args...)
		cmd.Dir = base
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// A DIR that is not a directory is refused before any image is built for it.
	if err := os.WriteFile(filepath.Join(base, "real", "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := run("mount", "--mode", "kernel", "demo", "link/file"); err == nil || !strings.Contains(out, "not a directory") {
		t.Errorf("mount --mode kernel onto a file: %v, %q; want it refused as not a directory", err, out)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.root, "kview", "images")); len(ents) != 0 {
		t.Errorf("an image was built for a mount onto a file: %v", ents)
	}
	if out, err := run("mount", "--mode", "kernel", "demo", "link/view"); err != nil {
		t.Fatalf("mount --mode kernel link/view: %v: %s", err, out)
	}
	if !kview.IsMounted(real) {
		t.Fatal("no kernel view mounted at the directory's real path")
	}
	if out, err := run("mount", "--mode", "kernel", "demo", "link/view"); err == nil || !strings.Contains(out, "already mounted") {
		t.Errorf("second mount at the same relative DIR: %v, %q; want it refused", err, out)
	}
	if ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) { return m.Mountpoint != real, false }); err != nil || len(ms) != 1 {
		t.Errorf("%d mounts at %s (%v), want 1", len(ms), real, err)
	}
	if out, err := run("umount", "link/view"); err != nil {
		t.Fatalf("umount link/view: %v: %s", err, out)
	}
	if kview.IsMounted(real) {
		t.Error("kernel view still mounted after umount by a relative DIR")
	}
}

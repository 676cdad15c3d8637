package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// asNobody runs cat on path as uid/gid 65534.
func asNobody(path string) (string, error) {
	cmd := exec.Command("cat", path)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, Groups: []uint32{}}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestMountOtherUsers: a view is the mounting user's alone unless --allow-other is
// given, and then the kernel checks the modes it reports (default_permissions).
func TestMountOtherUsers(t *testing.T) {
	e := newCLIEnv(t)
	base := t.TempDir()
	// Make the way to the mount points reachable, so only the view decides.
	for d := base; d != "/tmp" && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	private, shared := filepath.Join(base, "private"), filepath.Join(base, "shared")
	for _, d := range []string{private, shared} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e.start(t, private, "demo")
	if out, err := asNobody(filepath.Join(private, "hello.txt")); err == nil {
		t.Errorf("another user read a view mounted without --allow-other: %q", out)
	}
	if b, err := os.ReadFile(filepath.Join(private, "hello.txt")); err != nil || string(b) != "hello\n" {
		t.Errorf("the mounting user reads %q, %v", b, err)
	}
	e.start(t, shared, "--allow-other", "demo")
	if out, err := asNobody(filepath.Join(shared, "hello.txt")); err != nil || out != "hello\n" {
		t.Errorf("another user reading a --allow-other view: %q, %v", out, err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(mi), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == shared {
			if !strings.Contains(line, "default_permissions") || !strings.Contains(line, "allow_other") {
				t.Errorf("--allow-other view mounted without default_permissions: %s", line)
			}
			return
		}
	}
	t.Errorf("view at %s not in mountinfo", shared)
}

package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCommitSpecialFiles: FIFOs and device nodes in an upper are left out with a
// warning that counts them, and --strict refuses them, storing nothing.
func TestCommitSpecialFiles(t *testing.T) {
	state := t.TempDir()
	base, upper, want := commitTestSetup(t, state)
	if err := unix.Mkfifo(filepath.Join(upper, "app", "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	devs := 0
	if os.Geteuid() == 0 { // a block device 7/0 (loop0); whiteouts are char 0/0
		if err := unix.Mknod(filepath.Join(upper, "app", "lib", "blk"), unix.S_IFBLK|0o600, int(unix.Mkdev(7, 0))); err != nil {
			t.Fatal(err)
		}
		devs = 1
	}
	out, stderr, err := ingestTestCLI(t, state, "commit", "--base", base, "--upper", upper, "--prefix", "app")
	if err != nil {
		t.Fatalf("commit: %v\n%s", err, stderr)
	}
	if got := strings.TrimSpace(out); got != want {
		t.Errorf("commit root %s, want %s (the special files left out)", got, want)
	}
	if n := 1 + devs; !strings.Contains(stderr, "left out "+itoa(n)+" FIFOs, sockets or device nodes") {
		t.Errorf("commit stderr does not count the %d special files:\n%s", n, stderr)
	}
	before := snapshotDir(t, filepath.Join(state, "cas"))
	if err := os.WriteFile(filepath.Join(upper, "app", "more.txt"), []byte("new content for strict\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, stderr, err = ingestTestCLI(t, state, "commit", "--strict", "--base", base, "--upper", upper, "--prefix", "app")
	if err == nil || !strings.Contains(err.Error(), "fifo (FIFO)") || !strings.Contains(err.Error(), "cannot be stored") {
		t.Errorf("commit --strict: %v, stderr %q; want a refusal naming the FIFO", err, stderr)
	}
	if after := snapshotDir(t, filepath.Join(state, "cas")); after != before {
		t.Errorf("commit --strict changed the store:\nbefore %s\nafter  %s", before, after)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// snapshotDir lists a store's object files.
func snapshotDir(t *testing.T, dir string) string {
	var names []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && !strings.Contains(p, ".tidepool-gc.lock") {
			names = append(names, strings.TrimPrefix(p, dir))
		}
		return nil
	})
	return strings.Join(names, ",")
}

package faults

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// fillTo leaves about free bytes free on the filesystem holding dir, with one filler
// file, and returns the file's path.
func fillTo(t *testing.T, dir string, free int64) string {
	t.Helper()
	p := filepath.Join(dir, "filler")
	os.Remove(p)
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	avail := int64(st.Bavail) * st.Bsize
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if n := avail - free; n > 0 {
		if err := unix.Fallocate(int(f.Fd()), 0, 0, n); err != nil {
			t.Fatalf("fallocate %d: %v", n, err)
		}
	}
	return p
}

// objects lists the store's object files.
func (e *env) objects() string {
	var out []string
	filepath.WalkDir(filepath.Join(e.root, "cas"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && len(filepath.Base(filepath.Dir(p))) == 2 {
			out = append(out, filepath.Base(p))
		}
		return nil
	})
	sort.Strings(out)
	return strings.Join(out, ",")
}

// TestENOSPC runs ingest, commit and fork creation on a small tmpfs that runs out of
// space. Guarantees: a clear error naming the cause, nothing half-written (the
// store's objects, the temp directory and the fork records are as before, fsck is
// clean), and everything works again once there is space.
func TestENOSPC(t *testing.T) {
	e := newEnv(t)
	r := seed(t)
	mnt := t.TempDir()
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=24m,mode=0700"); err != nil {
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	e.root = filepath.Join(mnt, "root")

	small := filepath.Join(t.TempDir(), "small")
	writeTree(t, r, small, 20, 4096)
	base := lastLine(e.must("ingest", small))
	fork := e.must("fork", base)
	big := filepath.Join(t.TempDir(), "big")
	writeTree(t, r, big, 40, 256<<10) // ~5 MB
	upper := filepath.Join(t.TempDir(), "upper")
	writeTree(t, r, upper, 30, 256<<10)

	filler := fillTo(t, mnt, 1<<20)
	nospace := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s succeeded with 1 MB free", what)
		}
		if !strings.Contains(err.Error(), "no space left on device") {
			t.Errorf("%s: error does not say the disk is full: %v", what, err)
		}
	}
	before := e.objects()
	_, err := e.run("ingest", big)
	nospace("ingest", err)
	_, err = e.run("commit", "--base", fork, "--upper", upper)
	nospace("commit", err)
	if after := e.objects(); after != before {
		t.Error("a failed write changed the store's objects")
	}
	if left := e.tempFiles(); len(left) != 0 {
		t.Errorf("temp files left by failed writes: %v", left)
	}
	if got := e.forkRoot(fork); got != base {
		t.Errorf("fork moved to %s after a failed commit", got)
	}
	e.fsck("after failed ingest and commit")

	// The fork database: fill the disk entirely and create forks until one fails.
	fillTo(t, mnt, 0)
	made, failed, forkErr := 0, false, ""
	for i := 0; i < 2000 && !failed; i++ {
		if _, err := e.run("fork", "--label-kv", "pad="+strings.Repeat("x", 2000), base); err != nil {
			nospace("fork", err)
			failed, forkErr = true, err.Error()
		} else {
			made++
		}
	}
	if !failed {
		t.Fatal("2000 forks fit on a full disk?")
	}
	if n := len(e.forks()); n != made+1 {
		t.Errorf("%d fork records after %d creates succeeded (plus one), want %d", n, made, made+1)
	}
	e.fsck("after the fork database filled up")

	// Space returns: everything works again.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(mnt, "filler"))
	e.must("ingest", big)
	e.must("commit", "--base", fork, "--upper", upper)
	e.must("fork", base)
	e.fsck("once space returned")
	t.Logf("ENOSPC: ingest, commit and fork (after %d more forks) failed cleanly (fork: %s); all worked again with space", made, forkErr)
}

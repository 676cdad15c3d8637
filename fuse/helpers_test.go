package fuse

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/containerd/errdefs"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// goSrc is the real source tree the tests and benchmarks mount.
var goSrc = filepath.Join(runtime.GOROOT(), "src")

// testUID owns views in tests that check what a non-root user can do.
const testUID, testGID = 4242, 4343

func requireRoot(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("mounts FUSE views and overlays: skipped with -short")
	}
	if os.Geteuid() != 0 {
		tb.Skip("needs root: mounts FUSE views and overlays")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		tb.Skipf("needs /dev/fuse: %v", err)
	}
}

func newStore(tb testing.TB) *casstore.Store {
	tb.Helper()
	s, err := casstore.Open(filepath.Join(tb.TempDir(), "cas"))
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// ingestTree stores dir as a tree with the project's ingest (default rules: symlinks
// kept, .git and special files skipped).
func ingestTree(tb testing.TB, s *casstore.Store, dir string) casstore.Hash {
	tb.Helper()
	root, _, err := ingest.Dir(context.Background(), s, dir, ingest.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	return root
}

// writeFixture creates a small tree with every kind of entry a view serves.
func writeFixture(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	files := map[string]string{
		"README.md":           "# fixture\n",
		"src/main.go":         "package main\n\nfunc main() {}\n",
		"src/util/strings.go": "package util\n",
		"src/util/same-a.txt": "shared content\n",
		"src/util/same-b.txt": "shared content\n",
		"bin/run.sh":          "#!/bin/sh\necho run\n",
		"empty":               "",
		"big.bin":             strings.Repeat("0123456789abcdef", 1<<16), // 1 MiB
	}
	for name, content := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			tb.Fatal(err)
		}
		mode := os.FileMode(0o644)
		if strings.HasSuffix(name, ".sh") {
			mode = 0o755
		}
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			tb.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "emptydir"), 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.Symlink("src/main.go", filepath.Join(dir, "link")); err != nil {
		tb.Fatal(err)
	}
	if err := os.Symlink("../README.md", filepath.Join(dir, "src", "up")); err != nil {
		tb.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, ".git"), 0o755); err != nil {
		tb.Fatal(err)
	}
	return dir
}

// sharedDir is a temp dir that other uids can traverse (t.TempDir's parent is 0700),
// for mountpoints and overlays that non-root test processes use.
func sharedDir(tb testing.TB) string {
	tb.Helper()
	d := tb.TempDir()
	for _, p := range []string{filepath.Dir(d), d} {
		if err := os.Chmod(p, 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	return d
}

// mount mounts a view and unmounts it when the test ends, even on failure.
func mount(tb testing.TB, s *casstore.Store, root casstore.Hash, opts Options) *View {
	tb.Helper()
	return mountAt(tb, s, root, sharedDir(tb), opts)
}

// mountAt is mount at a given directory.
func mountAt(tb testing.TB, s *casstore.Store, root casstore.Hash, dir string, opts Options) *View {
	tb.Helper()
	v, err := Mount(context.Background(), s, root, dir, opts)
	if err != nil {
		tb.Fatalf("Mount: %v", err)
	}
	tb.Cleanup(func() {
		if err := v.Unmount(); err != nil {
			tb.Errorf("Unmount: %v", err)
			_ = UnmountStale(dir)
		}
	})
	return v
}

// mountOverlay mounts a kernel overlay of lowers (top first) with a real upper and
// work dir, and unmounts it when the test ends (before the views below it).
func mountOverlay(tb testing.TB, lowers ...string) (merged, upper string) {
	tb.Helper()
	base := sharedDir(tb)
	upper, work, merged := filepath.Join(base, "upper"), filepath.Join(base, "work"), filepath.Join(base, "merged")
	for _, d := range []string{upper, work, merged} {
		if err := os.Mkdir(d, 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", strings.Join(lowers, ":"), upper, work)
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		tb.Fatalf("mount overlay %s: %v", opts, err)
	}
	tb.Cleanup(func() {
		if err := unix.Unmount(merged, 0); err != nil {
			tb.Errorf("unmount overlay: %v", err)
			_ = unix.Unmount(merged, unix.MNT_DETACH)
		}
	})
	return merged, upper
}

// runAs runs a command as uid:gid (no supplementary groups) and returns its output.
func runAs(tb testing.TB, uid, gid uint32, name string, args ...string) (string, error) {
	tb.Helper()
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: []uint32{}}}
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// requirePassthrough fails the test if v does not use passthrough where it should:
// the kernel offers it and the store is not on a stacked filesystem (overlayfs or
// FUSE, where the kernel refuses backing files). Elsewhere it skips.
func requirePassthrough(tb testing.TB, v *View, s *casstore.Store) {
	tb.Helper()
	if v.server.KernelSettings().Flags64()&gofuse.CAP_PASSTHROUGH == 0 {
		tb.Skip("kernel does not offer FUSE passthrough")
	}
	var st unix.Statfs_t
	if err := unix.Statfs(s.Root(), &st); err != nil {
		tb.Fatal(err)
	}
	if st.Type == unix.OVERLAYFS_SUPER_MAGIC || st.Type == unix.FUSE_SUPER_MAGIC {
		tb.Skip("store is on a stacked filesystem: passthrough cannot use it")
	}
	if !v.PassthroughActive() {
		tb.Fatal("passthrough is not active although the kernel offers it and the store is on a plain filesystem")
	}
}

// mounted reports whether dir is a mountpoint in /proc/self/mountinfo.
func mounted(tb testing.TB, dir string) bool {
	tb.Helper()
	all, err := mounts(mountinfo.SingleEntryFilter(dir))
	if err != nil {
		tb.Fatal(err)
	}
	return len(all) > 0
}

// objects lists every object file in a store.
func objects(tb testing.TB, s *casstore.Store) map[casstore.Hash]bool {
	tb.Helper()
	out := map[casstore.Hash]bool{}
	if err := s.Walk(func(h casstore.Hash, _ string) error { out[h] = true; return nil }); err != nil {
		tb.Fatal(err)
	}
	return out
}

// storeFiles counts every regular file under the store root, temp files included.
func storeFiles(tb testing.TB, s *casstore.Store) int {
	tb.Helper()
	n := 0
	err := filepath.WalkDir(s.Root(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() && !strings.HasSuffix(p, ".lock") {
			n++
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return n
}

// fakeSource serves objects from another store, counting fetches per object; it can
// be told to lie about content or to hold fetches until released.
type fakeSource struct {
	from *casstore.Store

	mu      sync.Mutex
	fetches map[casstore.Hash]int
	stats   int
	lie     bool
	gate    chan struct{} // if non-nil, Fetch waits for it to close
}

func newFakeSource(from *casstore.Store) *fakeSource {
	return &fakeSource{from: from, fetches: map[casstore.Hash]int{}}
}

func (f *fakeSource) Stat(_ context.Context, h casstore.Hash) (int64, error) {
	f.mu.Lock()
	f.stats++
	f.mu.Unlock()
	return f.from.Size(h)
}

func (f *fakeSource) Fetch(ctx context.Context, h casstore.Hash) (io.ReadCloser, error) {
	f.mu.Lock()
	f.fetches[h]++
	lie, gate := f.lie, f.gate
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	ok, err := f.from.Has(h)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("fake source: %s: %w", h, errdefs.ErrNotFound)
	}
	data, err := f.from.ReadAll(h, 1<<30)
	if err != nil {
		return nil, err
	}
	if lie {
		data = append(bytes.Clone(data), "tampered"...)
	}
	return io.NopCloser(bytes.NewReader(data)), nil
}

func (f *fakeSource) fetchCount(h casstore.Hash) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fetches[h]
}

func (f *fakeSource) totalFetches() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.fetches {
		n += c
	}
	return n
}

// isErrno reports whether err carries errno.
func isErrno(err error, errno syscall.Errno) bool {
	var e syscall.Errno
	return errors.As(err, &e) && e == errno
}

// lookupHash resolves a slash path in a stored tree to its entry.
func lookupHash(tb testing.TB, s *casstore.Store, root casstore.Hash, p string) casstore.Entry {
	tb.Helper()
	e := casstore.Entry{Mode: casstore.ModeDir, Hash: root}
	for _, c := range strings.Split(p, "/") {
		t, err := s.ReadTree(e.Hash)
		if err != nil {
			tb.Fatal(err)
		}
		var ok bool
		if e, ok = t.Lookup(c); !ok {
			tb.Fatalf("%s: no entry %q", p, c)
		}
	}
	return e
}

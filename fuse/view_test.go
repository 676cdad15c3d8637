package fuse

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// The Go source tree is ingested once per test binary into a shared store.
var goTree struct {
	once sync.Once
	dir  string
	s    *casstore.Store
	root casstore.Hash
	err  error
}

func TestMain(m *testing.M) {
	if p := os.Getenv(mmapHelperEnv); p != "" {
		os.Exit(mmapCompare(p, os.Getenv(mmapWantEnv)))
	}
	code := m.Run()
	if goTree.dir != "" {
		os.RemoveAll(goTree.dir)
	}
	os.Exit(code)
}

func goStore(tb testing.TB) (*casstore.Store, casstore.Hash) {
	tb.Helper()
	goTree.once.Do(func() {
		goTree.dir, goTree.err = os.MkdirTemp("", "tidepool-fuse-gotree-")
		if goTree.err != nil {
			return
		}
		goTree.s, goTree.err = casstore.Open(filepath.Join(goTree.dir, "cas"))
		if goTree.err != nil {
			return
		}
		goTree.root, _, goTree.err = ingest.Dir(context.Background(), goTree.s, goSrc, ingest.Options{})
	})
	if goTree.err != nil {
		tb.Fatalf("ingest %s: %v", goSrc, goTree.err)
	}
	return goTree.s, goTree.root
}

// compareTree walks the original and checks that the view holds exactly the same
// names, types, modes (0644/0755/0777), link targets and contents, owned by uid:gid
// with nlink 1 and the view's mtime.
func compareTree(t *testing.T, orig, view string, uid, gid uint32, mtime time.Time) int {
	t.Helper()
	files := 0
	err := filepath.WalkDir(orig, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Name() == ".git" {
			return filepath.SkipDir
		}
		rel, _ := filepath.Rel(orig, p)
		vp := filepath.Join(view, rel)
		oi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		vi, err := os.Lstat(vp)
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			return nil
		}
		st := vi.Sys().(*syscall.Stat_t)
		if st.Uid != uid || st.Gid != gid {
			t.Errorf("%s: owner %d:%d, want %d:%d", rel, st.Uid, st.Gid, uid, gid)
		}
		if !vi.ModTime().Equal(mtime) {
			t.Errorf("%s: mtime %v, want %v", rel, vi.ModTime(), mtime)
		}
		switch {
		case oi.IsDir():
			if vi.Mode() != fs.ModeDir|0o755 {
				t.Errorf("%s: mode %v, want drwxr-xr-x", rel, vi.Mode())
			}
			on, _ := os.ReadDir(p)
			vn, err := os.ReadDir(vp)
			if err != nil {
				t.Errorf("%s: readdir: %v", rel, err)
				return nil
			}
			var want []string
			for _, e := range on {
				if e.Name() != ".git" && (e.Type().IsDir() || e.Type().IsRegular() || e.Type()&fs.ModeSymlink != 0) {
					want = append(want, e.Name())
				}
			}
			var got []string
			for _, e := range vn {
				got = append(got, e.Name())
			}
			if strings.Join(got, "\x00") != strings.Join(want, "\x00") {
				t.Errorf("%s: listing %q, want %q", rel, got, want)
			}
		case oi.Mode()&fs.ModeSymlink != 0:
			if vi.Mode() != fs.ModeSymlink|0o777 {
				t.Errorf("%s: mode %v, want Lrwxrwxrwx", rel, vi.Mode())
			}
			ot, _ := os.Readlink(p)
			vt, err := os.Readlink(vp)
			if err != nil || vt != ot {
				t.Errorf("%s: link %q (%v), want %q", rel, vt, err, ot)
			}
			if vi.Size() != int64(len(ot)) {
				t.Errorf("%s: link size %d, want %d", rel, vi.Size(), len(ot))
			}
		case oi.Mode().IsRegular():
			files++
			want := fs.FileMode(0o644)
			if oi.Mode()&0o111 != 0 {
				want = 0o755
			}
			if vi.Mode() != want {
				t.Errorf("%s: mode %v, want %v", rel, vi.Mode(), want)
			}
			if st.Nlink != 1 {
				t.Errorf("%s: nlink %d, want 1", rel, st.Nlink)
			}
			if vi.Size() != oi.Size() {
				t.Errorf("%s: size %d, want %d", rel, vi.Size(), oi.Size())
			}
			ob, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			vb, err := os.ReadFile(vp)
			if err != nil {
				t.Errorf("%s: read: %v", rel, err)
			} else if !bytes.Equal(ob, vb) {
				t.Errorf("%s: content differs", rel)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func TestGoTreeMatchesSource(t *testing.T) {
	requireRoot(t)
	s, root := goStore(t)
	mtime := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)

	t.Run("passthrough", func(t *testing.T) {
		v := mount(t, s, root, Options{UID: testUID, GID: testGID, Mtime: mtime})
		requirePassthrough(t, v, s)
		files := compareTree(t, goSrc, v.Dir(), testUID, testGID, mtime)
		st := v.Stats()
		if files < 10000 {
			t.Fatalf("compared only %d files", files)
		}
		if got := st.Opens.Load(); got < uint64(files) {
			t.Errorf("opens = %d, want >= %d", got, files)
		}
		if st.PassthroughOpens.Load() != st.Opens.Load() {
			t.Errorf("passthrough opens = %d of %d", st.PassthroughOpens.Load(), st.Opens.Load())
		}
		if got := st.Reads.Load(); got != 0 {
			t.Errorf("%d READ requests reached the server; passthrough should serve them all", got)
		}
		// A non-root user (the owner here) reads everything: diff runs as that uid.
		if out, err := runAs(t, testUID, testGID, "diff", "-r", "-q", goSrc, v.Dir()); err != nil {
			t.Errorf("diff -r as uid %d: %v\n%s", testUID, err, out)
		}
		// So does any other uid (allow_other; files are 0644 or 0755).
		if out, err := runAs(t, 5555, 5555, "cat", filepath.Join(v.Dir(), "go.mod"), filepath.Join(v.Dir(), "strings/strings.go")); err != nil {
			t.Errorf("cat as uid 5555: %v\n%s", err, out)
		}
	})

	t.Run("plain reads", func(t *testing.T) {
		v := mount(t, s, root, Options{DisablePassthrough: true, Mtime: mtime})
		if v.PassthroughActive() {
			t.Fatal("passthrough active although disabled")
		}
		files := compareTree(t, goSrc, v.Dir(), 0, 0, mtime)
		st := v.Stats()
		if st.PassthroughOpens.Load() != 0 {
			t.Errorf("passthrough opens = %d, want 0", st.PassthroughOpens.Load())
		}
		if st.Reads.Load() == 0 {
			t.Errorf("no READ requests reached the server for %d files", files)
		}
	})

	t.Run("noopen", func(t *testing.T) {
		v := mount(t, s, root, Options{NoOpen: true, UID: testUID, GID: testGID, Mtime: mtime})
		requireOpenMode(t, v, true)
		files := compareTree(t, goSrc, v.Dir(), testUID, testGID, mtime)
		st := v.Stats()
		if st.Opens.Load() != 0 {
			t.Errorf("opens = %d; the kernel should open files without asking", st.Opens.Load())
		}
		reads := st.Reads.Load()
		if reads == 0 {
			t.Fatalf("no READ requests reached the server for %d files", files)
		}
		// The page cache outlives the opens: a second pass reads next to nothing.
		// (TestWarmPassRequests checks for nothing at all, on a part of the tree: on
		// the whole tree, the pages the kernel evicts by itself here, a few dozen a
		// second even without memory pressure, natively read files' too, would make
		// that flaky. A view that kept nothing would re-read everything.)
		size := readTree(t, goSrc, make([]byte, 256<<10))
		if got := readTree(t, v.Dir(), make([]byte, 256<<10)); got != size {
			t.Errorf("second pass read %d bytes, want %d", got, size)
		}
		if got := st.Reads.Load() - reads; got > reads/10 {
			t.Errorf("second pass: %d READ requests reached the server (first pass: %d)", got, reads)
		}
		if out, err := runAs(t, testUID, testGID, "diff", "-r", "-q", goSrc, v.Dir()); err != nil {
			t.Errorf("diff -r as uid %d: %v\n%s", testUID, err, out)
		}
	})
}

func TestAttributes(t *testing.T) {
	requireRoot(t)
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	mtime := time.Date(2020, 1, 2, 3, 4, 5, 600, time.UTC)
	v := mount(t, s, root, Options{Prefix: "srv/api", UID: testUID, GID: testGID, Mtime: mtime})
	d := v.Dir()

	stat := func(p string) *syscall.Stat_t {
		t.Helper()
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(d, p), &st); err != nil {
			t.Fatalf("lstat %s: %v", p, err)
		}
		return &st
	}
	check := func(p string, mode, uid, gid uint32) *syscall.Stat_t {
		t.Helper()
		st := stat(p)
		if st.Mode != mode || st.Uid != uid || st.Gid != gid {
			t.Errorf("%s: mode %o owner %d:%d, want %o %d:%d", p, st.Mode, st.Uid, st.Gid, mode, uid, gid)
		}
		if st.Mtim.Nano() != mtime.UnixNano() || st.Ctim.Nano() != mtime.UnixNano() || st.Atim.Nano() != mtime.UnixNano() {
			t.Errorf("%s: times %v %v %v, want %v", p, st.Atim, st.Mtim, st.Ctim, mtime)
		}
		return st
	}
	// The view root and prefix parents are synthesized and owned by root; the tree
	// root and everything below it belong to the owner.
	check("", syscall.S_IFDIR|0o755, 0, 0)
	check("srv", syscall.S_IFDIR|0o755, 0, 0)
	check("srv/api", syscall.S_IFDIR|0o755, testUID, testGID)
	check("srv/api/src", syscall.S_IFDIR|0o755, testUID, testGID)
	check("srv/api/emptydir", syscall.S_IFDIR|0o755, testUID, testGID)
	readme := check("srv/api/README.md", syscall.S_IFREG|0o644, testUID, testGID)
	check("srv/api/bin/run.sh", syscall.S_IFREG|0o755, testUID, testGID)
	check("srv/api/link", syscall.S_IFLNK|0o777, testUID, testGID)
	if readme.Size != int64(len("# fixture\n")) {
		t.Errorf("README size %d", readme.Size)
	}
	if ents, _ := os.ReadDir(d); len(ents) != 1 || ents[0].Name() != "srv" {
		t.Errorf("view root lists %v, want only srv", ents)
	}
	if ents, _ := os.ReadDir(filepath.Join(d, "srv")); len(ents) != 1 || ents[0].Name() != "api" {
		t.Errorf("srv lists %v, want only api", ents)
	}
	if _, err := os.Lstat(filepath.Join(d, "app")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("lookup outside the prefix: %v, want ENOENT", err)
	}

	// Two paths sharing a blob are two files, not a hard link.
	a, b := stat("srv/api/src/util/same-a.txt"), stat("srv/api/src/util/same-b.txt")
	if a.Ino == b.Ino || a.Nlink != 1 || b.Nlink != 1 {
		t.Errorf("shared blob: inos %d %d nlink %d %d; want distinct inos, nlink 1", a.Ino, b.Ino, a.Nlink, b.Nlink)
	}
	// st_blocks comes from the object file.
	big := stat("srv/api/big.bin")
	var obj syscall.Stat_t
	if err := syscall.Stat(s.Path(lookupHash(t, s, root, "big.bin").Hash), &obj); err != nil {
		t.Fatal(err)
	}
	if big.Size != 1<<20 || big.Blocks != obj.Blocks || big.Blocks == 0 {
		t.Errorf("big.bin size %d blocks %d, want %d blocks %d", big.Size, big.Blocks, 1<<20, obj.Blocks)
	}
	if e := stat("srv/api/empty"); e.Size != 0 {
		t.Errorf("empty: size %d", e.Size)
	}
	// readdir's d_ino agrees with stat's st_ino.
	ents, err := os.ReadDir(filepath.Join(d, "srv/api/src/util"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		info, _ := e.Info()
		if info.Sys().(*syscall.Stat_t).Ino != stat("srv/api/src/util/"+e.Name()).Ino {
			t.Errorf("%s: readdir and stat disagree on the inode", e.Name())
		}
	}
	// Symlinks read back their targets.
	if got, err := os.Readlink(filepath.Join(d, "srv/api/src/up")); err != nil || got != "../README.md" {
		t.Errorf("readlink src/up = %q, %v", got, err)
	}
	if got, err := os.ReadFile(filepath.Join(d, "srv/api/link")); err != nil || string(got) != "package main\n\nfunc main() {}\n" {
		t.Errorf("reading through link = %q, %v", got, err)
	}
	// .git was not ingested; nothing else appears.
	if _, err := os.Stat(filepath.Join(d, "srv/api/.git")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf(".git: %v", err)
	}

	// The view is read-only.
	if err := os.WriteFile(filepath.Join(d, "srv/api/new"), nil, 0o644); !isErrno(err, syscall.EROFS) {
		t.Errorf("create: %v, want EROFS", err)
	}
	if _, err := os.OpenFile(filepath.Join(d, "srv/api/README.md"), os.O_WRONLY, 0); !isErrno(err, syscall.EROFS) {
		t.Errorf("open for writing: %v, want EROFS", err)
	}

	// Inode numbers are stable across remounts of the same root, whatever the
	// lookup order.
	inos := map[string]uint64{}
	for _, p := range []string{"srv", "srv/api", "srv/api/src/util/same-b.txt", "srv/api/README.md", "srv/api/link"} {
		inos[p] = stat(p).Ino
	}
	v2 := mount(t, s, root, Options{Prefix: "srv/api", UID: testUID, GID: testGID, Mtime: mtime})
	for _, p := range []string{"srv/api/link", "srv/api/README.md", "srv/api/src/util/same-b.txt", "srv/api", "srv"} {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(v2.Dir(), p), &st); err != nil {
			t.Fatal(err)
		}
		if st.Ino != inos[p] {
			t.Errorf("%s: ino %d after remount, was %d", p, st.Ino, inos[p])
		}
	}
}

func TestPrefixValidation(t *testing.T) {
	for _, p := range []string{"", "app", "srv/api", "a.b/c-d_e", "é"} {
		if err := ValidatePrefix(p); err != nil {
			t.Errorf("ValidatePrefix(%q) = %v", p, err)
		}
	}
	bad := []string{"/app", "app/", "./app", "a//b", "..", "../app", "a/../b", "a/.", ".", "a\x00b", "n\xffx"}
	for _, p := range bad {
		if err := ValidatePrefix(p); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("ValidatePrefix(%q) = %v, want invalid argument", p, err)
		}
	}
	if os.Geteuid() != 0 {
		return
	}
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	dir := t.TempDir()
	for _, p := range bad {
		if v, err := Mount(t.Context(), s, root, dir, Options{Prefix: p}); err == nil {
			v.Unmount()
			t.Errorf("Mount with prefix %q succeeded", p)
		}
	}
	if mounted(t, dir) {
		t.Error("a refused mount left a mount behind")
	}
}

func TestMountReadsNothing(t *testing.T) {
	requireRoot(t)
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	// Corrupt the root tree itself: mounting must still work (nothing is read), and
	// only listing the root fails.
	corrupt(t, s.Path(root))
	v := mount(t, s, root, Options{})
	if st := v.Stats(); st.Lookups.Load() != 0 || st.Readdirs.Load() != 0 || st.Opens.Load() != 0 {
		t.Errorf("mount did work: %d lookups, %d readdirs, %d opens", st.Lookups.Load(), st.Readdirs.Load(), st.Opens.Load())
	}
	if _, err := os.ReadDir(v.Dir()); !isErrno(err, syscall.EIO) {
		t.Errorf("readdir of a corrupt root: %v, want EIO", err)
	}
	if v.Stats().Errors(ErrCorrupt) == 0 {
		t.Error("corrupt tree not counted")
	}

	// A root that is in neither the store nor a source is refused up front.
	missing := casstore.Sum([]byte("no such tree"))
	if _, err := Mount(t.Context(), s, missing, t.TempDir(), Options{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("mount of a missing root: %v, want not found", err)
	}
}

// corrupt flips bytes of an object file in place (same size).
func corrupt(tb testing.TB, path string) {
	tb.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	if len(b) == 0 {
		tb.Fatalf("cannot corrupt empty object %s", path)
	}
	for i := range min(len(b), 8) {
		b[i] ^= 0xff
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		tb.Fatal(err)
	}
}

// objectFDs counts this process's descriptors open on files under dir (a store): the
// object files views keep. Every descriptor of the test process would also count
// what the test process opens or closes meanwhile for other reasons (a fresh-clone
// run once saw that total move by one either way).
//
// dir is resolved first: the kernel names a descriptor's file by its real path, so a
// store under a symlinked TMPDIR would otherwise match nothing and the count stay 0.
func objectFDs(tb testing.TB, dir string) int {
	tb.Helper()
	dir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		tb.Fatal(err)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && strings.HasPrefix(target, dir+"/") {
			n++
		}
	}
	return n
}

func cachedFiles(v *View) int {
	v.openMu.Lock()
	defer v.openMu.Unlock()
	return len(v.open)
}

// TestObjectFilesAreReleased checks the descriptors views keep for open-heavy
// workloads: shared while the kernel holds the inode, closed when it forgets it and
// at unmount, and not kept at all once the process budget is spent.
func TestObjectFilesAreReleased(t *testing.T) {
	forEachOpenMode(t, testObjectFilesAreReleased)
}

func testObjectFilesAreReleased(t *testing.T, noOpen bool) {
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	files := []string{"README.md", "src/main.go", "src/util/strings.go", "src/util/same-a.txt", "src/util/same-b.txt", "bin/run.sh", "big.bin", "empty"}
	want := len(files)
	if noOpen {
		want-- // the kernel never reads an empty file, so its object is never opened
	}
	before := objectFDs(t, s.Root())
	v, err := Mount(t.Context(), s, root, sharedDir(t), Options{NoOpen: noOpen})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Unmount() })
	requireOpenMode(t, v, noOpen)
	for range 3 {
		for _, f := range files {
			readString(t, filepath.Join(v.Dir(), f))
		}
	}
	if got := cachedFiles(v); got != want {
		t.Errorf("%d files keep an object open, want %d (one per file, shared by opens and reads)", got, want)
	}
	// The kernel forgetting an inode closes its object file.
	if errno := v.top.NotifyEntry("README.md"); errno != 0 {
		t.Fatalf("notify: %v", errno)
	}
	deadline := time.Now().Add(10 * time.Second)
	for cachedFiles(v) != want-1 {
		if time.Now().After(deadline) {
			t.Fatalf("%d cached after the kernel forgot README.md", cachedFiles(v))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := readString(t, filepath.Join(v.Dir(), "README.md")); got != "# fixture\n" {
		t.Errorf("README after forget: %q", got)
	}
	if err := v.Unmount(); err != nil {
		t.Fatal(err)
	}
	if after := objectFDs(t, s.Root()); after != before {
		t.Errorf("%d object descriptors open after unmount, %d before", after, before)
	}

	// With the budget spent, every open (or, in NoOpen mode, every read) gets and
	// releases its own descriptor.
	saved := openBudget.max
	openBudget.max = openBudget.used.Load()
	t.Cleanup(func() { openBudget.max = saved })
	v2, err := Mount(t.Context(), s, root, sharedDir(t), Options{DisablePassthrough: true, NoOpen: noOpen})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v2.Unmount() })
	for _, f := range files {
		readString(t, filepath.Join(v2.Dir(), f))
	}
	if got := cachedFiles(v2); got != 0 {
		t.Errorf("%d files cached over budget", got)
	}
	want1M, err := os.ReadFile(s.Path(lookupHash(t, s, root, "big.bin").Hash))
	if err != nil {
		t.Fatal(err)
	}
	if got := readString(t, filepath.Join(v2.Dir(), "big.bin")); got != string(want1M) {
		t.Errorf("big.bin over budget: %d bytes, want the object's %d", len(got), len(want1M))
	}
	if err := v2.Unmount(); err != nil {
		t.Fatal(err)
	}
	if after := objectFDs(t, s.Root()); after != before {
		t.Errorf("%d object descriptors open after unmounting the view over budget, %d before", after, before)
	}
}

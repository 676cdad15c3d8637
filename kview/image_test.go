package kview

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"
	"lukechampine.com/blake3"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

func fixture(t testing.TB, s *casstore.Store) casstore.Hash {
	t.Helper()
	return casstoretest.Build(t, s, map[string]casstoretest.Leaf{
		"README.md":         casstoretest.File("hello\n"),
		"empty":             casstoretest.File(""),
		"bin/run.sh":        casstoretest.Exec("#!/bin/sh\necho run\n"),
		"src/a/b/deep.go":   casstoretest.File("package b\n"),
		"src/main.go":       casstoretest.File("package main\n"),
		"src/same.go":       casstoretest.File("package main\n"), // shares main.go's object
		"link":              casstoretest.Link("src/main.go"),
		"nothing":           casstoretest.EmptyDir(),
		"src/a/b/large.bin": casstoretest.File(string(bytes.Repeat([]byte("0123456789abcdef"), 70000))),
	})
}

func buildImage(t testing.TB, s *casstore.Store, spec Spec) []byte {
	t.Helper()
	tr, err := Scan(context.Background(), s, spec)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "img.erofs"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := tr.WriteImage(f); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func openImage(t testing.TB, b []byte) fs.FS {
	t.Helper()
	img, err := erofs.Open(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func erofsStat(t testing.TB, fsys fs.FS, name string) *erofs.Stat {
	t.Helper()
	fi, err := fsys.(interface {
		Lstat(string) (fs.FileInfo, error)
	}).Lstat(name)
	if err != nil {
		t.Fatal(err)
	}
	st, ok := fi.Sys().(*erofs.Stat)
	if !ok {
		t.Fatalf("%s: Sys() is %T", name, fi.Sys())
	}
	return st
}

// TestImageLayout reads a built image back with go-erofs's reader and checks every
// rule: modes, owner, one mtime, sizes, the overlay xattrs, symlinks inline, prefix
// parents owned by 0:0, directory link counts.
func TestImageLayout(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	img := openImage(t, buildImage(t, s, Spec{Root: root, Prefix: "srv/app", UID: 1000, GID: 1001}))

	for _, p := range []string{".", "srv"} {
		st := erofsStat(t, img, p)
		if st.UID != 0 || st.GID != 0 || st.Mode != fs.ModeDir|0o755 {
			t.Errorf("prefix parent %s: uid %d gid %d mode %v, want 0:0 drwxr-xr-x", p, st.UID, st.GID, st.Mode)
		}
	}
	type want struct {
		mode  fs.FileMode
		size  int64
		data  string // the object the file redirects to
		nlink int
	}
	large := string(bytes.Repeat([]byte("0123456789abcdef"), 70000))
	for p, w := range map[string]want{
		"srv/app":                   {mode: fs.ModeDir | 0o755, nlink: 5},
		"srv/app/README.md":         {mode: 0o644, size: 6, data: "hello\n", nlink: 1},
		"srv/app/empty":             {mode: 0o644, nlink: 1},
		"srv/app/bin/run.sh":        {mode: 0o755, size: 19, data: "#!/bin/sh\necho run\n", nlink: 1},
		"srv/app/src":               {mode: fs.ModeDir | 0o755, nlink: 3},
		"srv/app/src/same.go":       {mode: 0o644, size: 13, data: "package main\n", nlink: 1},
		"srv/app/src/a/b/large.bin": {mode: 0o644, size: int64(len(large)), data: large, nlink: 1},
		"srv/app/link":              {mode: fs.ModeSymlink | 0o777, size: 11, nlink: 1},
		"srv/app/nothing":           {mode: fs.ModeDir | 0o755, nlink: 2},
	} {
		st := erofsStat(t, img, p)
		if st.Mode != w.mode || st.UID != 1000 || st.GID != 1001 || st.Mtime != Mtime || st.Nlink != w.nlink {
			t.Errorf("%s: mode %v uid %d gid %d mtime %d nlink %d, want %v 1000 1001 %d %d", p, st.Mode, st.UID, st.GID, st.Mtime, st.Nlink, w.mode, Mtime, w.nlink)
		}
		if !w.mode.IsRegular() {
			continue
		}
		if st.Size != w.size {
			t.Errorf("%s: size %d, want %d", p, st.Size, w.size)
		}
		if w.data == "" {
			if len(st.Xattrs) != 0 {
				t.Errorf("%s: empty file has xattrs %v", p, st.Xattrs)
			}
			continue
		}
		redirect := Redirect(casstore.Sum([]byte(w.data)))
		if v, ok := st.Xattrs[xattrMetacopy]; !ok || v != "" {
			t.Errorf("%s: %s = %q (present %v), want present and empty", p, xattrMetacopy, v, ok)
		}
		if st.Xattrs[xattrRedirect] != redirect {
			t.Errorf("%s: %s = %q, want %q", p, xattrRedirect, st.Xattrs[xattrRedirect], redirect)
		}
		// All holes: the image holds no file data.
		b, err := fs.ReadFile(img, p)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, make([]byte, w.size)) {
			t.Errorf("%s: image holds data; want an all-holes file", p)
		}
	}
	if target, err := img.(interface{ ReadLink(string) (string, error) }).ReadLink("srv/app/link"); err != nil || target != "src/main.go" {
		t.Errorf("link target %q, %v", target, err)
	}
}

// TestImageReproducible: the same spec gives the same bytes; any part of the spec
// changes them.
func TestImageReproducible(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	spec := Spec{Root: root, Prefix: "app", UID: 7, GID: 8}
	a, b := buildImage(t, s, spec), buildImage(t, s, spec)
	if !bytes.Equal(a, b) {
		t.Fatal("two builds of one spec differ")
	}
	for _, other := range []Spec{{Root: root, Prefix: "app", UID: 7, GID: 9}, {Root: root, Prefix: "ap", UID: 7, GID: 8}, {Root: root, UID: 7, GID: 8}} {
		if bytes.Equal(a, buildImage(t, s, other)) {
			t.Errorf("spec %+v gives the same image as %+v", other, spec)
		}
		if other.Key() == spec.Key() {
			t.Errorf("spec %+v has the same key as %+v", other, spec)
		}
	}
}

// TestRootInodeNotZero catches go-erofs v0.3.1's layout, which put the root directory at
// NID 0 (st_ino 0; glibc then hides "." and "..", and Go's os.ReadDir drops entries
// with d_ino 0). The reader reports the NID as Ino; the kernel test below checks the
// mounted image too.
func TestRootInodeNotZero(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	for _, prefix := range []string{"", "app"} {
		img := openImage(t, buildImage(t, s, Spec{Root: root, Prefix: prefix}))
		if ino := erofsStat(t, img, ".").Ino; ino == 0 {
			t.Errorf("prefix %q: root directory at NID 0", prefix)
		}
	}
}

// removeObject removes an object the way Tidepool does (garbage collection, fsck):
// the size index forgets it first.
func removeObject(t testing.TB, s *casstore.Store, h casstore.Hash) {
	t.Helper()
	if err := s.ForgetSizes([]casstore.Hash{h}); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(s.Path(h)); err != nil {
		t.Fatal(err)
	}
}

func TestScanMissing(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	gone := casstore.Sum([]byte("package b\n"))
	removeObject(t, s, gone)
	_, err := Scan(context.Background(), s, Spec{Root: root})
	var miss *MissingError
	if !errors.As(err, &miss) || !errdefs.IsNotFound(err) {
		t.Fatalf("scan with a missing object: %v, want a *MissingError matching NotFound", err)
	}
	if len(miss.Objects) != 1 || miss.Objects[0] != gone {
		t.Fatalf("missing %v, want [%s]", miss.Objects, gone)
	}
	if !bytes.Contains([]byte(err.Error()), []byte(gone.String())) {
		t.Errorf("error %q does not name the object", err)
	}
}

func TestScanRefusesBadTree(t *testing.T) {
	s := casstoretest.NewStore(t)
	obj := casstoretest.Put(t, s, "x")
	bad := casstoretest.RawTree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "../x", Hash: obj})
	if _, err := Scan(context.Background(), s, Spec{Root: bad}); err == nil {
		t.Fatal("scan of a tree with an escaping name succeeded")
	}
	notTree := casstoretest.Put(t, s, "not a tree at all")
	if _, err := Scan(context.Background(), s, Spec{Root: notTree}); err == nil {
		t.Fatal("scan of a non-tree succeeded")
	}
}

// TestScanSharedSubtrees: a tree object that appears at several paths (here at
// three depths, once through a shared parent) is scanned once and shown at every
// path: the image, read back with go-erofs's reader, holds every path with its size,
// the counts are per path, and the object list names each object once.
func TestScanSharedSubtrees(t *testing.T) {
	s := casstoretest.NewStore(t)
	lib := map[string]string{"lib/x.go": "package x\n", "lib/y/z.go": "package y\n", "lib/y/w": "w\n"}
	leaves := map[string]casstoretest.Leaf{"top.txt": casstoretest.File("top\n")}
	want := map[string]int64{"top.txt": 4}
	for _, at := range []string{"", "a/", "b/c/d/", "e/a/"} {
		for p, data := range lib {
			leaves[at+p] = casstoretest.File(data)
			want[at+p] = int64(len(data))
		}
	}
	leaves["e/extra"] = casstoretest.File("") // e is not a's parent (the root) again
	want["e/extra"] = 0
	root := casstoretest.Build(t, s, leaves)
	tr, err := Scan(context.Background(), s, Spec{Root: root, UID: 7, GID: 7})
	if err != nil {
		t.Fatal(err)
	}
	if tr.Files != len(want) || len(tr.objects) != 4 {
		t.Errorf("scan: %d files, %d objects; want %d files, 4 objects (each once)", tr.Files, len(tr.objects), len(want))
	}
	if tr.TreesRead >= tr.Dirs {
		t.Errorf("scan read %d tree objects for %d directories: shared ones were read again", tr.TreesRead, tr.Dirs)
	}
	img := openImage(t, buildImage(t, s, Spec{Root: root, UID: 7, GID: 7}))
	got := map[string]int64{}
	dirs := 0
	err = fs.WalkDir(img, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			dirs++
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		got[p] = fi.Size()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) || dirs != tr.Dirs {
		t.Fatalf("image holds %v in %d directories, want %v in %d", got, dirs, want, tr.Dirs)
	}
	compareWithGoErofs(t, tr, "shared subtrees")
}

// TestScanLimits: a view is held to the walk limits as it expands, every path
// counted, however its tree objects share subtrees. A tree naming 2^40 paths through
// shared subtrees fails (expanded, it would not end); so does one deeper than the limit, whether by a
// chain or by a subtree it also shows higher up (the second path is the deeper one);
// one exactly at the depth limit scans.
func TestScanLimits(t *testing.T) {
	s := casstoretest.NewStore(t)
	dir := func(name string, h casstore.Hash) casstore.Entry {
		return casstore.Entry{Mode: casstore.ModeDir, Name: name, Hash: h}
	}
	leaf := casstoretest.RawTree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "f", Hash: casstoretest.Put(t, s, "x")})
	bomb := leaf
	for range 40 {
		bomb = casstoretest.RawTree(t, s, dir("a", bomb), dir("b", bomb))
	}
	chain := func(n int, below casstore.Hash) casstore.Hash {
		for range n {
			below = casstoretest.RawTree(t, s, dir("d", below))
		}
		return below
	}
	limits := casstore.DefaultLimits()
	shared := chain(10, leaf) // ten levels of directories below it
	for _, c := range []struct {
		name string
		root casstore.Hash
		ok   bool
		says string
	}{
		{"2^40 paths", bomb, false, "entries"},
		{"a chain at the limit", chain(limits.MaxDepth, leaf), true, ""},
		{"a chain past the limit", chain(limits.MaxDepth+1, leaf), false, "deeper"},
		{"a shared subtree at the limit", casstoretest.RawTree(t, s, dir("a", shared), dir("b", chain(limits.MaxDepth-11, shared))), true, ""},
		{"a shared subtree past the limit", casstoretest.RawTree(t, s, dir("a", shared), dir("b", chain(limits.MaxDepth-10, shared))), false, "deeper"},
	} {
		_, err := Scan(context.Background(), s, Spec{Root: c.root})
		switch {
		case c.ok && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case !c.ok && (!errors.Is(err, casstore.ErrTreeLimit) || !strings.Contains(fmt.Sprint(err), c.says)):
			t.Errorf("%s: %v, want ErrTreeLimit (%s)", c.name, err, c.says)
		}
	}
}

// TestScanReadsObjectsWhole covers both ways an object is read (read's single pread
// into a pooled buffer, and its careful path for anything else): a tree object larger
// than the buffer scans like a small one, and a tree object whose file is corrupt,
// truncated, a directory or a FIFO fails the scan with an error that names it, never
// a wrong image.
func TestScanReadsObjectsWhole(t *testing.T) {
	s := casstoretest.NewStore(t)
	leaves := map[string]casstoretest.Leaf{"link": casstoretest.Link("big/f0000")}
	for i := range 1000 { // about 1000*(40+45) bytes: past read's 64 KiB buffer
		leaves[fmt.Sprintf("big/f%04d-%s", i, strings.Repeat("n", 40))] = casstoretest.File(fmt.Sprint(i))
	}
	root := casstoretest.Build(t, s, leaves)
	tree, err := s.ReadTree(root)
	if err != nil {
		t.Fatal(err)
	}
	big := tree[0].Hash
	if info, err := os.Stat(s.Path(big)); err != nil || info.Size() <= 64<<10 {
		t.Fatalf("tree object big: %v, %v: want one larger than 64 KiB", info, err)
	}
	tr, err := Scan(context.Background(), s, Spec{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	if tr.Files != 1000 || tr.TreesRead != 2 {
		t.Fatalf("scan: %d files, %d trees read; want 1000 and 2", tr.Files, tr.TreesRead)
	}
	if n := tr.top.children[1]; n.name != "link" || n.target != "big/f0000" {
		t.Fatalf("symlink scanned as %q -> %q", n.name, n.target)
	}

	good, err := os.ReadFile(s.Path(big))
	if err != nil {
		t.Fatal(err)
	}
	replace := func(t *testing.T, make func(p string) error) {
		t.Helper()
		p := s.Path(big)
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := make(p); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			os.RemoveAll(p)
			if err := os.WriteFile(p, good, 0o600); err != nil {
				t.Fatal(err)
			}
		})
	}
	flipped := bytes.Clone(good)
	flipped[len(flipped)/2] ^= 1
	for _, c := range []struct {
		name string
		make func(p string) error
		is   func(error) bool
	}{
		{"corrupt", func(p string) error { return os.WriteFile(p, flipped, 0o600) },
			func(err error) bool { var c *casstore.CorruptError; return errors.As(err, &c) }},
		{"truncated to fit the buffer", func(p string) error { return os.WriteFile(p, good[:1000], 0o600) },
			func(err error) bool { var c *casstore.CorruptError; return errors.As(err, &c) }},
		{"a directory", func(p string) error { return os.Mkdir(p, 0o700) }, errdefs.IsDataLoss},
		{"a FIFO", func(p string) error { return unix.Mkfifo(p, 0o600) }, errdefs.IsDataLoss},
	} {
		t.Run(c.name, func(t *testing.T) {
			replace(t, c.make)
			_, err := Scan(context.Background(), s, Spec{Root: root})
			if err == nil || !c.is(err) {
				t.Fatalf("scan over a tree object that is %s: %v", c.name, err)
			}
			if !strings.Contains(err.Error(), big.String()) {
				t.Errorf("error %q does not name the object", err)
			}
		})
	}
}

// sizeRecord encodes one size index record (casstore/sizes.go): hash, size u64 LE,
// the first 8 bytes of BLAKE3 of those 40 bytes.
func sizeRecord(h casstore.Hash, size uint64) []byte {
	b := append(h[:], binary.LittleEndian.AppendUint64(nil, size)...)
	sum := blake3.Sum256(b)
	return append(b, sum[:8]...)
}

// TestScanSizesIndexOrStat: sizes come from the store's size index, fall back to a
// stat where the index lacks an entry or its entries disagree, and the image is the
// same byte for byte whichever way each size was learnt.
func TestScanSizesIndexOrStat(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	spec := Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000}
	scan := func() *Tree {
		t.Helper()
		tr, err := Scan(context.Background(), s, spec)
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	// README.md, bin/run.sh, deep.go, main.go, same.go, large.bin (empty has no object).
	if tr := scan(); tr.Indexed != 6 || tr.Stated != 0 {
		t.Fatalf("fresh store: %d sizes from the index, %d stat-ed; want 6, 0", tr.Indexed, tr.Stated)
	}
	want := buildImage(t, s, spec)

	// Entries that disagree: the large file's hash recorded with another size too.
	large := casstore.Sum(bytes.Repeat([]byte("0123456789abcdef"), 70000))
	idx := filepath.Join(s.Root(), ".tidepool-sizes")
	f, err := os.OpenFile(idx, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(sizeRecord(large, 4096))
	f.Close()
	if tr := scan(); tr.Indexed != 5 || tr.Stated != 1 {
		t.Fatalf("disagreeing entries: %d indexed, %d stat-ed; want 5, 1", tr.Indexed, tr.Stated)
	}
	if got := buildImage(t, s, spec); !bytes.Equal(got, want) {
		t.Fatal("image differs when a size came from a stat")
	}
	st := erofsStat(t, openImage(t, want), "app/src/a/b/large.bin")
	if st.Size != 16*70000 {
		t.Fatalf("large.bin: size %d in the image", st.Size)
	}

	// No index at all (objects stored by LunarFS, or the file lost): every size by stat.
	if err := os.Remove(idx); err != nil {
		t.Fatal(err)
	}
	if tr := scan(); tr.Indexed != 0 || tr.Stated != 6 {
		t.Fatalf("no index: %d indexed, %d stat-ed; want 0, 6", tr.Indexed, tr.Stated)
	}
	if got := buildImage(t, s, spec); !bytes.Equal(got, want) {
		t.Fatal("image differs when every size came from a stat")
	}
}

// TestScanMemo: a scan that takes decoded trees from the memo gives the same image as
// one that reads them, still finds file objects that went missing, and the memo
// stays within its bound.
func TestScanMemo(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	memo := newTreeMemo(1000)
	image := func(spec Spec, memo *treeMemo) []byte {
		t.Helper()
		tr, err := scan(context.Background(), s, spec, memo, &scratch{})
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if err := tr.WriteImage(&buf); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	for _, spec := range []Spec{{Root: root}, {Root: root, Prefix: "app", UID: 7, GID: 8}} {
		want := image(spec, nil)
		image(spec, memo) // fills the memo
		if got := image(spec, memo); !bytes.Equal(got, want) {
			t.Fatalf("%+v: image from memoized trees differs", spec)
		}
	}
	if len(memo.m) == 0 {
		t.Fatal("the memo remembered nothing")
	}
	// A file object removed: the memoized scan still reports it.
	gone := casstore.Sum([]byte("package b\n"))
	removeObject(t, s, gone)
	_, err := scan(context.Background(), s, Spec{Root: root}, memo, &scratch{})
	var miss *MissingError
	if !errors.As(err, &miss) || len(miss.Objects) != 1 || miss.Objects[0] != gone {
		t.Fatalf("memoized scan with a missing object: %v", err)
	}
	// The bound: a memo of 3 entries never holds more.
	small := newTreeMemo(3)
	if _, err := s.PutBytes([]byte("package b\n")); err != nil {
		t.Fatal(err)
	}
	image(Spec{Root: root}, small)
	if small.entries > 3 {
		t.Fatalf("memo holds %d entries, bound 3", small.entries)
	}
}

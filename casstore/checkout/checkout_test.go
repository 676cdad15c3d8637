package checkout

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// ingestDir hashes dir with the product's ingest (default options: symlinks kept,
// an executable is any file with an x bit), so a test can check that a checkout
// reproduces a tree exactly by hashing the result again.
func ingestDir(t testing.TB, s *casstore.Store, dir string) casstore.Hash {
	t.Helper()
	h, _, err := ingest.Dir(context.Background(), s, dir, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// sample builds a small tree with every kind of entry on disk and ingests it.
func sample(t *testing.T, s *casstore.Store) casstore.Hash {
	t.Helper()
	src := t.TempDir()
	write := func(p, data string, perm os.FileMode) {
		full := filepath.Join(src, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(data), perm); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(full, perm); err != nil {
			t.Fatal(err)
		}
	}
	write("README.md", "# hello\n", 0o644)
	write("bin/run.sh", "#!/bin/sh\necho hi\n", 0o755)
	write("src/a/b/deep.go", "package b\n", 0o644)
	write("src/empty.txt", "", 0o644)
	write("big.bin", strings.Repeat("0123456789abcdef", 1<<16), 0o644) // 1 MiB
	if err := os.MkdirAll(filepath.Join(src, "empty/dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"link": "README.md", "src/up": "../bin/run.sh", "abs": "/etc/passwd", "dangling": "nowhere"} {
		if err := os.Symlink(target, filepath.Join(src, name)); err != nil {
			t.Fatal(err)
		}
	}
	return ingestDir(t, s, src)
}

type info struct {
	mode os.FileMode
	data string
}

// snapshot records every path under dir with its type, permissions and content (or
// link target), so tests can compare directories exactly.
func snapshot(t *testing.T, dir string) map[string]info {
	t.Helper()
	out := map[string]info{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		in := info{mode: fi.Mode()}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			in.data, err = os.Readlink(p)
		case fi.Mode().IsRegular():
			var b []byte
			b, err = os.ReadFile(p)
			in.data = string(b)
		}
		out[rel] = in
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func setUmask(t *testing.T, m int) {
	old := syscall.Umask(m)
	t.Cleanup(func() { syscall.Umask(old) })
}

func TestCheckoutReproducesTree(t *testing.T) {
	setUmask(t, 0o077) // modes must not depend on the caller's umask
	s := casstoretest.NewStore(t)
	root := sample(t, s)
	dst := filepath.Join(t.TempDir(), "out")
	st, err := Checkout(context.Background(), s, root, dst, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Files != 5 || st.Symlinks != 4 || st.Dirs != 6 || st.Bytes != 1<<20+8+18+10 {
		t.Fatalf("stats %+v", st)
	}
	if got := ingestDir(t, s, dst); got != root {
		t.Fatalf("re-ingested checkout gives %s, want %s", got, root)
	}
	snap := snapshot(t, dst)
	want := map[string]os.FileMode{
		".": fs.ModeDir | 0o755, "README.md": 0o644, "bin": fs.ModeDir | 0o755, "bin/run.sh": 0o755,
		"src/a/b/deep.go": 0o644, "src/empty.txt": 0o644, "empty/dir": fs.ModeDir | 0o755,
		"link": fs.ModeSymlink | 0o777, "abs": fs.ModeSymlink | 0o777,
	}
	for p, m := range want {
		if snap[p].mode != m {
			t.Errorf("%s: mode %v, want %v", p, snap[p].mode, m)
		}
	}
	if snap["abs"].data != "/etc/passwd" || snap["src/up"].data != "../bin/run.sh" || snap["bin/run.sh"].data != "#!/bin/sh\necho hi\n" {
		t.Fatalf("content mismatch: %+v", snap)
	}
}

func TestCheckoutRealSourceTree(t *testing.T) {
	src := filepath.Join(runtime.GOROOT(), "src", "net", "http")
	if _, err := os.Stat(src); err != nil {
		t.Skipf("Go source tree not available: %v", err)
	}
	s := casstoretest.NewStore(t)
	root := ingestDir(t, s, src)
	dst := t.TempDir()
	st, err := Checkout(context.Background(), s, root, dst, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Files < 100 {
		t.Fatalf("only %d files checked out", st.Files)
	}
	if got := ingestDir(t, s, dst); got != root {
		t.Fatalf("re-ingested checkout gives %s, want %s", got, root)
	}
}

func TestCheckoutPrefix(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := sample(t, s)
	dst := t.TempDir() // exists and is empty: allowed
	st, err := Checkout(context.Background(), s, root, dst, Options{Prefix: "srv/app/"})
	if err != nil {
		t.Fatal(err)
	}
	if st.Dirs != 6 {
		t.Fatalf("prefix directories counted: %+v", st)
	}
	names, _ := os.ReadDir(dst)
	if len(names) != 1 || names[0].Name() != "srv" {
		t.Fatalf("top level holds %v, want only srv", names)
	}
	if got := ingestDir(t, s, filepath.Join(dst, "srv", "app")); got != root {
		t.Fatalf("tree under the prefix gives %s, want %s", got, root)
	}
}

func TestCheckoutRefusesBadTargets(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := sample(t, s)
	tmp := t.TempDir()
	nonEmpty := filepath.Join(tmp, "full")
	if err := os.MkdirAll(filepath.Join(nonEmpty, "keep"), 0o755); err != nil {
		t.Fatal(err)
	}
	aFile := filepath.Join(tmp, "file")
	if err := os.WriteFile(aFile, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dir, prefix string
		want        error
	}{
		{nonEmpty, "", errdefs.ErrAlreadyExists},
		{aFile, "", errdefs.ErrAlreadyExists},
		{filepath.Join(tmp, "new1"), "/abs", errdefs.ErrInvalidArgument},
		{filepath.Join(tmp, "new2"), "../up", errdefs.ErrInvalidArgument},
		{filepath.Join(tmp, "new3"), "a/../../b", errdefs.ErrInvalidArgument},
		{filepath.Join(tmp, "new4"), "a//b", errdefs.ErrInvalidArgument},
		{filepath.Join(tmp, "new5"), ".", errdefs.ErrInvalidArgument},
	} {
		before := snapshot(t, tmp)
		_, err := Checkout(context.Background(), s, root, tc.dir, Options{Prefix: tc.prefix})
		if !errors.Is(err, tc.want) {
			t.Errorf("dir %s prefix %q: got %v, want %v", tc.dir, tc.prefix, err, tc.want)
		}
		if after := snapshot(t, tmp); len(after) != len(before) {
			t.Errorf("dir %s prefix %q: the file system changed: %v -> %v", tc.dir, tc.prefix, before, after)
		}
	}
}

// breakObject finds the object of path inside root and replaces or removes it.
func breakObject(t *testing.T, s *casstore.Store, root casstore.Hash, path string, corrupt bool) casstore.Hash {
	t.Helper()
	h := root
	for _, name := range strings.Split(path, "/") {
		tr, err := s.ReadTree(h)
		if err != nil {
			t.Fatal(err)
		}
		e, ok := tr.Lookup(name)
		if !ok {
			t.Fatalf("no %s in the tree", path)
		}
		h = e.Hash
	}
	p := s.Path(h)
	if corrupt {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		b[0] ^= 0xff
		if err := os.WriteFile(p+".new", b, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(p+".new", p); err != nil {
			t.Fatal(err)
		}
	} else if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	return h
}

func TestCheckoutFailureNamesObjectAndCleansUp(t *testing.T) {
	for _, tc := range []struct {
		name, path string
		corrupt    bool
		want       error
	}{
		{"missing blob", "src/a/b/deep.go", false, errdefs.ErrNotFound},
		{"corrupt blob", "src/a/b/deep.go", true, errdefs.ErrDataLoss},
		{"missing tree", "src/a", false, errdefs.ErrNotFound},
		{"corrupt tree", "src/a/b", true, errdefs.ErrDataLoss},
		{"corrupt symlink target", "src/up", true, errdefs.ErrDataLoss},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := casstoretest.NewStore(t)
			root := sample(t, s)
			h := breakObject(t, s, root, tc.path, tc.corrupt)
			check := func(err error) {
				t.Helper()
				if !errors.Is(err, tc.want) {
					t.Fatalf("got %v, want %v", err, tc.want)
				}
				if !strings.Contains(err.Error(), tc.path) || !strings.Contains(err.Error(), h.String()) {
					t.Fatalf("error does not name %s and %s: %v", tc.path, h, err)
				}
			}

			// A directory that did not exist, with missing parents: all of it goes.
			parent := filepath.Join(t.TempDir(), "a")
			_, err := Checkout(context.Background(), s, root, filepath.Join(parent, "b", "c"), Options{})
			check(err)
			if _, err := os.Lstat(parent); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("created parent left behind: %v", err)
			}

			// An existing empty directory stays, empty.
			dst := t.TempDir()
			_, err = Checkout(context.Background(), s, root, dst, Options{Prefix: "p/q"})
			check(err)
			if left := snapshot(t, dst); len(left) != 1 {
				t.Fatalf("left behind: %v", left)
			}
		})
	}
}

func TestCheckoutRefusesUnsafeNames(t *testing.T) {
	s := casstoretest.NewStore(t)
	blob := casstoretest.Put(t, s, "pwned")
	base := t.TempDir()
	for _, name := range []string{"..", "../escape", "a/b", "."} {
		root := casstoretest.RawTree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: name, Hash: blob})
		dst := filepath.Join(base, "sub", "dst")
		_, err := Checkout(context.Background(), s, root, dst, Options{})
		if !errors.Is(err, casstore.ErrBadName) {
			t.Fatalf("name %q: got %v, want ErrBadName", name, err)
		}
		if left := snapshot(t, base); len(left) != 1 {
			t.Fatalf("name %q: left behind %v", name, left)
		}
	}
}

func TestCheckoutSymlinkTargetsAreNotFollowed(t *testing.T) {
	s := casstoretest.NewStore(t)
	outside := t.TempDir()
	target := casstoretest.Put(t, s, outside)
	data := casstoretest.Put(t, s, "data")
	sub := casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "f", Hash: data})
	// "a" links outside; "b" is a directory next to it. Nothing may land outside.
	root := casstoretest.Tree(t, s,
		casstore.Entry{Mode: casstore.ModeSymlink, Name: "a", Hash: target},
		casstore.Entry{Mode: casstore.ModeDir, Name: "b", Hash: sub},
	)
	dst := t.TempDir()
	if _, err := Checkout(context.Background(), s, root, dst, Options{}); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.Readlink(filepath.Join(dst, "a")); got != outside {
		t.Fatalf("link target %q", got)
	}
	if left, _ := os.ReadDir(outside); len(left) != 0 {
		t.Fatalf("wrote outside the target: %v", left)
	}
}

func TestCheckoutEmptyObjectsNeedNoBlob(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := casstoretest.Tree(t, s,
		casstore.Entry{Mode: casstore.ModeFile, Name: "empty", Hash: casstore.EmptyHash},
		casstore.Entry{Mode: casstore.ModeDir, Name: "emptydir", Hash: casstore.EmptyHash},
	)
	if ok, _ := s.Has(casstore.EmptyHash); ok {
		t.Fatal("test needs a store without H(\"\")")
	}
	dst := t.TempDir()
	if _, err := Checkout(context.Background(), s, root, dst, Options{}); err != nil {
		t.Fatal(err)
	}
	snap := snapshot(t, dst)
	if snap["empty"].mode != 0o644 || snap["empty"].data != "" || !snap["emptydir"].mode.IsDir() {
		t.Fatalf("got %+v", snap)
	}
	// The empty root is an empty directory.
	dst2 := filepath.Join(t.TempDir(), "x")
	if _, err := Checkout(context.Background(), s, casstore.EmptyHash, dst2, Options{}); err != nil {
		t.Fatal(err)
	}
	if snap := snapshot(t, dst2); len(snap) != 1 {
		t.Fatalf("got %v", snap)
	}
}

func TestCheckoutCancel(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := sample(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	dst := filepath.Join(t.TempDir(), "x")
	if _, err := Checkout(ctx, s, root, dst, Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v", err)
	}
	if _, err := os.Lstat(dst); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("cancelled checkout left its directory")
	}
}

func TestSplitPrefix(t *testing.T) {
	for in, want := range map[string][]string{"": nil, "app": {"app"}, "srv/api/": {"srv", "api"}} {
		got, err := SplitPrefix(in)
		if err != nil || strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("SplitPrefix(%q) = %q, %v", in, got, err)
		}
	}
	bad := []string{"/", "/a", "..", "a/..", "a/./b", "a//b", "a\x00b"}
	for _, in := range bad {
		if _, err := SplitPrefix(in); err == nil {
			t.Errorf("SplitPrefix(%q) accepted", in)
		}
	}
}

package ingest

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (overlay mounts, mknod, trusted.* xattrs); run the tests as root")
	}
}

// objects lists every object in the store, and fails if any temp file was left.
func objects(t testing.TB, s *casstore.Store) []string {
	t.Helper()
	var out []string
	if err := s.Walk(func(h casstore.Hash, _ string) error {
		out = append(out, h.String())
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	tmp, err := os.ReadDir(filepath.Join(s.Root(), ".tidepool-tmp"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if len(tmp) != 0 {
		t.Fatalf("store has %d leftover temp files", len(tmp))
	}
	sort.Strings(out)
	return out
}

func writeFile(t testing.TB, path, content string, perm os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, perm); err != nil { // the umask does not get a say
		t.Fatal(err)
	}
}

func mkdirs(t testing.TB, paths ...string) {
	t.Helper()
	for _, p := range paths {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func symlink(t testing.TB, target, path string) {
	t.Helper()
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
}

func mkfifo(t testing.TB, path string) {
	t.Helper()
	if err := unix.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustDir(t testing.TB, s *casstore.Store, path string, opts Options) casstore.Hash {
	t.Helper()
	h, _, err := Dir(context.Background(), s, path, opts)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// listing renders a root as sorted "path mode hash" lines, for readable failures.
func listing(t testing.TB, s *casstore.Store, root casstore.Hash) []string {
	t.Helper()
	var out []string
	var walk func(prefix string, h casstore.Hash)
	walk = func(prefix string, h casstore.Hash) {
		tree, err := s.ReadTree(h)
		if err != nil {
			t.Fatalf("read tree %s: %v", prefix, err)
		}
		for _, e := range tree {
			p := prefix + e.Name
			out = append(out, fmt.Sprintf("%q %s %s", p, e.Mode, e.Hash.Short()))
			if e.Mode.IsDir() {
				walk(p+"/", e.Hash)
			}
		}
	}
	walk("", root)
	return out
}

func diffListings(a, b []string) string {
	in := func(xs []string) map[string]bool {
		m := map[string]bool{}
		for _, x := range xs {
			m[x] = true
		}
		return m
	}
	ma, mb := in(a), in(b)
	var sb strings.Builder
	for _, x := range a {
		if !mb[x] {
			fmt.Fprintf(&sb, "  - %s\n", x)
		}
	}
	for _, x := range b {
		if !ma[x] {
			fmt.Fprintf(&sb, "  + %s\n", x)
		}
	}
	return sb.String()
}

// checkout materializes a root from the store into dst (which must not exist). It is
// the test's own small helper; the product's checkout lives elsewhere.
func checkout(t testing.TB, s *casstore.Store, root casstore.Hash, dst string) {
	t.Helper()
	if err := checkoutTree(s, root, dst); err != nil {
		t.Fatal(err)
	}
}

func checkoutTree(s *casstore.Store, h casstore.Hash, dst string) error {
	if err := os.Mkdir(dst, 0o755); err != nil {
		return err
	}
	tree, err := s.ReadTree(h)
	if err != nil {
		return err
	}
	for _, e := range tree { // DecodeTree refused unsafe names, so Join stays inside dst
		p := filepath.Join(dst, e.Name)
		switch e.Mode {
		case casstore.ModeDir:
			if err := checkoutTree(s, e.Hash, p); err != nil {
				return err
			}
		case casstore.ModeSymlink:
			target, err := s.ReadAll(e.Hash, 4096)
			if err != nil {
				return err
			}
			if err := os.Symlink(string(target), p); err != nil {
				return err
			}
		default:
			src, err := s.Open(e.Hash)
			if err != nil {
				return err
			}
			f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, e.Mode.FileMode())
			if err == nil {
				_, err = io.Copy(f, src)
				if cerr := f.Close(); err == nil {
					err = cerr
				}
			}
			src.Close()
			if err != nil {
				return err
			}
			if err := os.Chmod(p, e.Mode.FileMode()); err != nil {
				return err
			}
		}
	}
	return nil
}

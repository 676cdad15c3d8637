package kview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// crashFixture is a tree whose image spans many blocks and whose object list and
// owner slots span more than a page, so that a cut at a block boundary (what a crash
// leaves of a file written back in part) loses some of each.
func crashFixture(t testing.TB, s *casstore.Store) casstore.Hash {
	t.Helper()
	leaves := map[string]casstoretest.Leaf{"link": casstoretest.Link("d000/f.go")}
	for i := 0; i < 600; i++ {
		leaves[fmt.Sprintf("d%03d/f.go", i)] = casstoretest.File(fmt.Sprintf("package d%03d\n", i))
	}
	return casstoretest.Build(t, s, leaves)
}

// cutTo leaves the cache file key+ext of the images directory dir with its first n
// bytes (n < 0: half its size, rounded down to a 4 KiB block), as a host crash
// leaves a file whose pages were not all written back.
func cutTo(t *testing.T, dir, key, ext string, n int64) {
	t.Helper()
	p := filepath.Join(dir, key+ext)
	if n < 0 {
		info, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if n = info.Size() / 2 &^ 4095; n == 0 {
			t.Fatalf("%s is %d bytes: too small to cut at a block", p, info.Size())
		}
	}
	if err := os.Truncate(p, n); err != nil {
		t.Fatal(err)
	}
}

// checkView checks that the view at dir shows exactly the tree root, every entry
// owned by uid.
func checkView(t *testing.T, dir string, root casstore.Hash, uid uint32) {
	t.Helper()
	got, _, err := ingest.Dir(context.Background(), casstoretest.NewStore(t), dir, ingest.Options{})
	if err != nil || got != root {
		t.Fatalf("the view shows %s, %v; want the tree %s", got, err, root)
	}
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if st := info.Sys().(*syscall.Stat_t); st.Uid != uid && p != dir {
			return fmt.Errorf("%s is owned by %d, want %d", p, st.Uid, uid)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestCacheEntryCutShort: what a host crash can leave of a cache entry, whose files
// are written without an fsync (entry.go): any of them shorter than written, down to
// empty. The process that finds such an entry (a tidepoold started after the crash)
// builds it again and mounts a view that shows the whole tree, owned by its owner; an
// object list cut short does not pass for proof that the tree's objects are local.
func TestCacheEntryCutShort(t *testing.T) {
	requireKernel(t)
	ctx := context.Background()
	spec := func(root casstore.Hash) Spec { return Spec{Root: root, UID: 1000, GID: 1000} }
	// written builds the entry of spec in a new cache, as the process before the crash.
	written := func(t *testing.T) (*casstore.Store, casstore.Hash, string) {
		s := casstoretest.NewStore(t)
		root := crashFixture(t, s)
		dir := filepath.Join(t.TempDir(), "images")
		h, err := NewHost(s, dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Prebuild(ctx, spec(root)); err != nil {
			t.Fatal(err)
		}
		return s, root, dir
	}
	for _, tc := range []struct {
		name string
		ext  string
		n    int64
	}{
		{"empty image", ".erofs", 0},
		{"image cut at a block", ".erofs", -1},
		{"empty record", ".json", 0},
		{"empty object list", ".objects", 0},
		{"object list cut at a block", ".objects", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, root, dir := written(t)
			key := spec(root).Key()
			cutTo(t, dir, key, tc.ext, tc.n)
			after, err := NewHost(s, dir) // the process after the crash
			if err != nil {
				t.Fatal(err)
			}
			mnt := mountT(t, after, spec(root))
			checkView(t, mnt, root, 1000)
			if b := after.Stats().Builds.Load(); b != 1 {
				t.Errorf("%d images built after the crash, want 1: the entry was used as it was", b)
			}
			if roots, err := after.Cache().MountedRoots(); err != nil || len(roots) != 1 || roots[0] != root {
				t.Errorf("mounted roots %v, %v; want [%s]", roots, err, root)
			}
		})
	}

	// An object named only in the part of the list the crash cut off is gone from
	// the store: the view is not mounted, and the error names that object.
	t.Run("object list cut, an object gone", func(t *testing.T) {
		s, root, dir := written(t)
		key := spec(root).Key()
		list, err := os.ReadFile(filepath.Join(dir, key+".objects"))
		if err != nil {
			t.Fatal(err)
		}
		var gone casstore.Hash
		copy(gone[:], list[len(list)-len(gone):])
		cutTo(t, dir, key, ".objects", int64(len(list)-len(gone)))
		removeObject(t, s, gone)
		after, err := NewHost(s, dir)
		if err != nil {
			t.Fatal(err)
		}
		mnt := t.TempDir()
		t.Cleanup(func() { _ = after.Unmount(ctx, mnt) })
		err = after.Mount(ctx, mnt, spec(root))
		var miss *MissingError
		if !errors.As(err, &miss) || len(miss.Objects) != 1 || miss.Objects[0] != gone {
			t.Fatalf("mount with object %s gone and cut from the list: %v, want it named missing", gone, err)
		}
		if IsMounted(mnt) {
			t.Fatal("a view was mounted anyway")
		}
	})

	// The owner slots cut short: a view for another owner (derived from this entry
	// when it is whole) shows every entry owned by that owner.
	t.Run("owner slots cut at a block", func(t *testing.T) {
		s, root, dir := written(t)
		cutTo(t, dir, spec(root).Key(), ".owners", -1)
		after, err := NewHost(s, dir)
		if err != nil {
			t.Fatal(err)
		}
		other := Spec{Root: root, UID: 1001, GID: 1001}
		checkView(t, mountT(t, after, other), root, 1001)
		if d, b := after.Stats().Derived.Load(), after.Stats().Builds.Load(); d != 0 || b != 1 {
			t.Errorf("%d images derived, %d built; want 0 and 1: an entry with its owner slots cut was derived from", d, b)
		}
		// The cut entry itself is made again when it is used (derived from the whole
		// entry just built, or built).
		checkView(t, mountT(t, after, spec(root)), root, 1000)
		if d, b := after.Stats().Derived.Load(), after.Stats().Builds.Load(); d+b != 2 {
			t.Errorf("%d images derived, %d built; want 2 in all: the cut entry was used", d, b)
		}
	})
}

// TestCacheEntryFromAnEarlierVersion: an entry whose record has no sizes (written
// before records had them) is not derived from, its root's trees are still decoded
// when a process starts (WarmTrees), and its first use builds it again, with sizes.
func TestCacheEntryFromAnEarlierVersion(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	dir := t.TempDir()
	spec := Spec{Root: root, UID: 1000, GID: 1000}
	if _, err := openCache(t, dir, s).image(ctx, spec); err != nil {
		t.Fatal(err)
	}
	record := filepath.Join(dir, spec.Key()+".json")
	b, err := os.ReadFile(record)
	if err != nil {
		t.Fatal(err)
	}
	var m meta
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	old, err := json.Marshal(map[string]any{"root": m.Root, "prefix": m.Prefix, "uid": m.UID, "gid": m.GID, "files": m.Files, "bytes": m.Bytes})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(record, old, 0o600); err != nil {
		t.Fatal(err)
	}
	c := openCache(t, dir, s)
	if len(c.lastRoots) != 1 || c.lastRoots[0] != root {
		t.Errorf("roots to warm %v, want [%s]", c.lastRoots, root)
	}
	if _, ok := c.sibling(Spec{Root: root, UID: 1001, GID: 1001}); ok {
		t.Error("an entry without sizes is in the owner index")
	}
	if _, err := c.image(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if b := c.stats.Builds.Load(); b != 1 {
		t.Errorf("%d images built, want 1", b)
	}
	if _, err := c.wholeEntry(spec.Key(), spec); err != nil {
		t.Errorf("the entry after its first use: %v", err)
	}
}

// TestCacheDirRemoved: the cache directory removed under a running process (an
// operator clearing a cache) is made again by the next build, and the images it
// held are made again when used (for another owner too).
func TestCacheDirRemoved(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	dir := filepath.Join(t.TempDir(), "kview", "images")
	c := openCache(t, dir, s)
	spec := Spec{Root: root, UID: 1000, GID: 1000}
	if _, err := c.image(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Dir(dir)); err != nil {
		t.Fatal(err)
	}
	for _, sp := range []Spec{spec, {Root: root, UID: 1001, GID: 1001}} {
		img, err := c.image(ctx, sp)
		if err != nil {
			t.Fatalf("image for %d after the cache directory was removed: %v", sp.UID, err)
		}
		if _, err := c.wholeEntry(sp.Key(), sp); err != nil {
			t.Errorf("%s: %v", img, err)
		}
	}
	if b, d := c.stats.Builds.Load(), c.stats.Derived.Load(); b+d != 3 {
		t.Errorf("%d images built and %d derived, want 3 in all", b, d)
	}
	if info, err := os.Stat(dir); err != nil || info.Mode().Perm() != 0o700 {
		t.Errorf("cache directory made again: %v, %v; want mode 0700", info, err)
	}
}

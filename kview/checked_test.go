package kview

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// openCache opens the image cache at dir over s, as a tidepoold process does.
func openCache(t testing.TB, dir string, s *casstore.Store) *Cache {
	t.Helper()
	c, err := NewCache(dir, s, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestCacheHitChecksWhatMayHaveChanged: a cache hit checks an image's object list
// against the store only when the size index may answer differently than when the
// list was last found whole in it: after an entry is forgotten (an object removed),
// in a new process, and every time for lists with objects the index does not know.
// Whenever it skips the check, the objects are all there.
func TestCacheHitChecksWhatMayHaveChanged(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	dir := t.TempDir()
	c := openCache(t, dir, s)
	spec := Spec{Root: root, UID: 1000, GID: 1000}
	image := func(c *Cache, spec Spec, checks int64) error {
		t.Helper()
		_, err := c.image(ctx, spec)
		if got := c.stats.ObjectChecks.Load(); got != checks {
			t.Fatalf("%d object lists checked, want %d", got, checks)
		}
		return err
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(image(c, spec, 0)) // built: the scan found every object in the index
	must(image(c, spec, 0))
	if _, err := s.PutBytes([]byte("another object")); err != nil {
		t.Fatal(err)
	}
	must(image(c, spec, 0)) // entries added: nothing the list needs can be gone
	// Another owner's image is derived from this one, and its list needs no check.
	other := Spec{Root: root, UID: 1001, GID: 1001}
	must(image(c, other, 0))
	if d := c.stats.Derived.Load(); d != 1 {
		t.Fatalf("%d images derived, want 1", d)
	}
	must(image(c, other, 0))

	// An object removed (its entry forgotten first, as gc and fsck do): the next hit
	// checks, and finds it missing, every time until it is back.
	gone := casstore.Sum([]byte("package b\n"))
	removeObject(t, s, gone)
	var miss *MissingError
	if err := image(c, spec, 1); !errors.As(err, &miss) || len(miss.Objects) != 1 || miss.Objects[0] != gone {
		t.Fatalf("hit with an object removed: %v", err)
	}
	if err := image(c, other, 2); !errors.As(err, &miss) {
		t.Fatalf("derived image's hit with an object removed: %v", err)
	}
	if err := image(c, spec, 3); !errors.As(err, &miss) {
		t.Fatalf("second hit with an object removed: %v", err)
	}
	if _, err := s.PutBytes([]byte("package b\n")); err != nil {
		t.Fatal(err)
	}
	must(image(c, spec, 4))
	must(image(c, spec, 4))

	// A new process knows nothing of the last one's checks.
	c2 := openCache(t, dir, s)
	must(image(c2, spec, 1))
	must(image(c2, spec, 1))

	// Without the index, every object is stat-ed on every hit.
	if err := os.Remove(filepath.Join(s.Root(), ".tidepool-sizes")); err != nil {
		t.Fatal(err)
	}
	must(image(c2, spec, 2))
	must(image(c2, spec, 3))
	if err := os.Remove(s.Path(gone)); err != nil {
		t.Fatal(err)
	}
	if err := image(c2, spec, 4); !errors.As(err, &miss) {
		t.Fatalf("hit with an object removed, no index: %v", err)
	}
}

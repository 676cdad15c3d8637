package kview

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// residentPages counts the pages of the file at p that are in the page cache.
func residentPages(p string) (in, total int, err error) {
	f, err := os.Open(p)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	return residentFile(f)
}

// resident counts the pages of the file at p that are in the page cache.
func resident(t *testing.T, p string) (in, total int) {
	t.Helper()
	in, total, err := residentPages(p)
	if err != nil {
		t.Fatal(err)
	}
	return in, total
}

// TestPrefetchImage: an image whose pages left the page cache is read back into it
// by prefetchImage (the mount path's readahead), without anything reading the file.
func TestPrefetchImage(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	img := filepath.Join(t.TempDir(), "img.erofs")
	if err := os.WriteFile(img, buildImage(t, s, Spec{Root: root}), 0o600); err != nil {
		t.Fatal(err)
	}
	evict(t, img)
	prefetchImage(context.Background(), img)
	waitResident(t, img)
}

package kview

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

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
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	// Clean pages can be dropped: sync them, then drop them.
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if in, total := resident(t, img); in == total {
		t.Skipf("could not drop the image's %d pages from the page cache", total)
	}
	prefetchImage(context.Background(), img)
	deadline := time.Now().Add(10 * time.Second)
	for {
		in, total := resident(t, img)
		if in == total {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of the image's %d pages in the page cache 10 s after prefetchImage", in, total)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

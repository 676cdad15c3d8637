package kview

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// evict drops the clean pages of the file at p from the page cache (sync, then
// POSIX_FADV_DONTNEED), skipping the test if the kernel keeps them.
func evict(t *testing.T, p string) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if in, total := resident(t, p); in*2 >= total {
		t.Skipf("could not drop %s's pages from the page cache (%d of %d cached)", p, in, total)
	}
}

// waitResident waits up to 10 s for every page of the file at p to be cached.
func waitResident(t *testing.T, p string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		in, total := resident(t, p)
		if in == total {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d of %d pages cached 10 s after its read-ahead", p, in, total)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// bigObjects puts n objects of 64 KiB each into s and returns their hashes in order.
func bigObjects(t *testing.T, s *casstore.Store, n int) []casstore.Hash {
	t.Helper()
	var hs []casstore.Hash
	for i := 0; i < n; i++ {
		h, err := s.PutBytes(bytes.Repeat([]byte(fmt.Sprintf("object %d\n", i)), 64<<10/10))
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	return hs
}

func writeList(t *testing.T, hs ...casstore.Hash) string {
	t.Helper()
	var b []byte
	for _, h := range hs {
		b = append(b, h[:]...)
	}
	p := filepath.Join(t.TempDir(), "k.objects")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestImageCold: an image whose pages left the page cache is cold; once read, it is
// not.
func TestImageCold(t *testing.T) {
	imageCold := func(p string) (bool, error) {
		f, err := os.Open(p)
		if err != nil {
			return false, err
		}
		defer f.Close()
		return imageCold(f)
	}
	s := casstoretest.NewStore(t)
	img := filepath.Join(t.TempDir(), "img.erofs")
	if err := os.WriteFile(img, buildImage(t, s, Spec{Root: fixture(t, s)}), 0o600); err != nil {
		t.Fatal(err)
	}
	evict(t, img)
	if cold, err := imageCold(img); err != nil || !cold {
		t.Fatalf("evicted image: cold %v, %v; want cold", cold, err)
	}
	if _, err := os.ReadFile(img); err != nil {
		t.Fatal(err)
	}
	if cold, err := imageCold(img); err != nil || cold {
		t.Fatalf("image just read: cold %v, %v; want warm", cold, err)
	}
	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if cold, err := imageCold(empty); err != nil || cold {
		t.Fatalf("empty file: cold %v, %v", cold, err)
	}
	if _, _, err := residentPages(filepath.Join(t.TempDir(), "gone")); err == nil {
		t.Fatal("a missing image: no error")
	}
}

// TestColdReadAhead: the read-ahead brings the listed objects into the page cache in
// the background, skips objects the store does not have, and stops at its budget.
func TestColdReadAhead(t *testing.T) {
	s := casstoretest.NewStore(t)
	hs := bigObjects(t, s, 8)
	for _, h := range hs {
		evict(t, s.Path(h))
	}
	absent := casstore.Sum([]byte("not in the store"))
	list := writeList(t, append([]casstore.Hash{absent}, hs...)...)

	stats := &Stats{}
	r := newColdReader(s, stats)
	defer r.close()
	objects, n, err := r.read(context.Background(), list, 1<<40)
	if err != nil || objects != len(hs) || n != int64(len(hs))*(64<<10/10*9) {
		t.Fatalf("read ahead %d objects, %d bytes, %v; want %d objects", objects, n, err, len(hs))
	}
	for _, h := range hs {
		waitResident(t, s.Path(h))
	}

	// A budget of one byte: every worker stops after its first object.
	for _, h := range hs {
		evict(t, s.Path(h))
	}
	objects, _, err = r.read(context.Background(), writeList(t, hs...), 1)
	if err != nil || objects < 1 || objects > coldPrefetchWorkers {
		t.Fatalf("budget of 1 byte: %d objects read ahead, %v; want 1 to %d", objects, err, coldPrefetchWorkers)
	}
	if in, _ := resident(t, s.Path(hs[len(hs)-1])); in != 0 {
		t.Fatalf("the last object, past the budget, has %d pages cached", in)
	}

	// A list that is gone is an error; a cancelled context stops the read-ahead.
	if _, _, err := r.read(context.Background(), filepath.Join(t.TempDir(), "gone"), 1<<40); err == nil {
		t.Fatal("missing list: no error")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if objects, _, err := r.read(ctx, list, 1<<40); err == nil || objects != 0 {
		t.Fatalf("cancelled: %d objects, %v", objects, err)
	}
}

// TestMountColdReadAhead: mounting a view whose image left the page cache reads its
// files' objects ahead (once per image, counted in Stats); mounting it while the
// image is cached does not.
func TestMountColdReadAhead(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	root := casstoretest.Build(t, s, map[string]casstoretest.Leaf{
		"a.txt":     casstoretest.File(string(bytes.Repeat([]byte("a"), 256<<10))),
		"sub/b.txt": casstoretest.File(string(bytes.Repeat([]byte("b"), 256<<10))),
	})
	h := newHost(t, s)
	defer h.Close()
	h.ColdReadAhead = 1 << 30
	spec := Spec{Root: root}
	mountT(t, h, spec) // just built: the image is cached
	if n := h.Stats().ColdReadAheads.Load(); n != 0 {
		t.Fatalf("a view mounted with its image cached read ahead %d times", n)
	}
	objs := []casstore.Hash{casstore.Sum(bytes.Repeat([]byte("a"), 256<<10)), casstore.Sum(bytes.Repeat([]byte("b"), 256<<10))}
	evict(t, h.Cache().path(spec.Key(), ".erofs"))
	for _, o := range objs {
		evict(t, s.Path(o))
	}
	mountT(t, h, spec)
	deadline := time.Now().Add(10 * time.Second)
	for h.Stats().ColdReadAheads.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("no read-ahead 10 s after a view was mounted with its image evicted")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got, want := h.Stats().ColdReadAheadBytes.Load(), int64(2*256<<10); got != want {
		t.Fatalf("read ahead %d bytes, want %d", got, want)
	}
	for _, o := range objs {
		waitResident(t, s.Path(o))
	}
	mountT(t, h, spec)
	h.Close() // waits for any read-ahead
	if n := h.Stats().ColdReadAheads.Load(); n != 1 {
		t.Fatalf("%d read-aheads after a third mount with the image cached, want 1", n)
	}
}

// TestColdReadAheadsTakeTurns: no more than coldReadAheadsAtOnce read-aheads run at
// once; another waits for a turn, and closing the reader drops the waiting ones.
func TestColdReadAheadsTakeTurns(t *testing.T) {
	s := casstoretest.NewStore(t)
	list := writeList(t, bigObjects(t, s, 2)...)
	stats := &Stats{}
	r := newColdReader(s, stats)
	for range coldReadAheadsAtOnce { // as if that many ran
		r.slots <- struct{}{}
	}
	r.start(context.Background(), "a", list, 1<<40)
	r.start(context.Background(), "a", list, 1<<40) // a read-ahead of a is waiting: nothing more
	time.Sleep(100 * time.Millisecond)
	if n := stats.ColdReadAheads.Load(); n != 0 {
		t.Fatalf("%d read-aheads ran while every turn was taken", n)
	}
	<-r.slots // one ends
	deadline := time.Now().Add(10 * time.Second)
	for stats.ColdReadAheads.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("a waiting read-ahead did not run when a turn came free")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got, want := stats.ColdReadAheadBytes.Load(), int64(2*(64<<10/10*9)); got != want {
		t.Fatalf("read ahead %d bytes, want %d (one read-ahead of a)", got, want)
	}
	r.slots <- struct{}{} // every turn taken again
	r.start(context.Background(), "b", list, 1<<40)
	r.close() // drops b, which waits, and returns
	if n := stats.ColdReadAheads.Load(); n != 1 {
		t.Fatalf("%d read-aheads after close, want 1", n)
	}
	r.start(context.Background(), "c", list, 1<<40) // closed: nothing starts
	if n := stats.ColdReadAheads.Load(); n != 1 {
		t.Fatalf("%d read-aheads after a start on a closed reader, want 1", n)
	}
}

package kview

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// TestSlab: take hands out zeroed, disjoint slices, larger ones than a chunk included;
// after reset the same arrays are handed out again, zeroed.
func TestSlab(t *testing.T) {
	var s slab[int]
	sizes := []int{3, minSlabChunk - 3, 1, 5 * minSlabChunk, 7, 0, 2 * minSlabChunk}
	for round := 0; round < 3; round++ {
		var got [][]int
		for i, n := range sizes {
			b := s.take(n)
			if len(b) != n || cap(b) != n {
				t.Fatalf("round %d: take(%d) gave len %d cap %d", round, n, len(b), cap(b))
			}
			for _, v := range b {
				if v != 0 {
					t.Fatalf("round %d: take(%d) not zeroed", round, n)
				}
			}
			for j := range b {
				b[j] = i + 1
			}
			got = append(got, b)
		}
		for i, b := range got { // nothing handed out twice
			for _, v := range b {
				if v != i+1 {
					t.Fatalf("round %d: slice %d overwritten", round, i)
				}
			}
		}
		chunks := len(s.chunks)
		s.reset()
		if round > 0 && len(s.chunks) != chunks {
			t.Fatalf("round %d: %d arrays, had %d", round, len(s.chunks), chunks)
		}
	}
	if n := s.bytes(); n < 8*(9*minSlabChunk) {
		t.Fatalf("slab keeps %d bytes, less than it handed out", n)
	}
}

// wideTree is a tree of files directories apart, enough entries to fill several of
// a slab's arrays.
func wideTree(t *testing.T, s *casstore.Store, files int, salt string) casstore.Hash {
	t.Helper()
	leaves := map[string]casstoretest.Leaf{}
	for i := range files {
		leaves[fmt.Sprintf("d%02d/e%d/f%d.txt", i%40, i%3, i)] = casstoretest.File(fmt.Sprintf("%s %d\n", salt, i))
	}
	leaves["l"] = casstoretest.Link("d00")
	return casstoretest.Build(t, s, leaves)
}

// TestCacheBuildsInKeptScratch: one cache's builds and derivations, one after another,
// all run in the scratch the first one left (larger trees, smaller ones, a build that
// stopped halfway on a missing object), and each writes the image and object list
// that a build in fresh memory writes.
func TestCacheBuildsInKeptScratch(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	big, small := wideTree(t, s, 3000, "big"), fixture(t, s)
	other := wideTree(t, s, 1200, "other")
	broken := wideTree(t, s, 2500, "broken")
	tr, err := Scan(ctx, s, Spec{Root: broken})
	if err != nil {
		t.Fatal(err)
	}
	removeObject(t, s, tr.objects[len(tr.objects)-1]) // found late in the walk

	c := openCache(t, t.TempDir(), s)
	var first *scratch
	image := func(spec Spec) {
		t.Helper()
		img, err := c.image(ctx, spec)
		if err != nil {
			t.Fatalf("%+v: %v", spec, err)
		}
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		if want := buildImage(t, s, spec); !bytes.Equal(got, want) {
			t.Fatalf("image of %+v differs from a build's in fresh memory", spec)
		}
		objs, err := os.ReadFile(c.path(spec.Key(), ".objects"))
		if err != nil {
			t.Fatal(err)
		}
		tr, err := Scan(ctx, s, spec)
		if err != nil {
			t.Fatal(err)
		}
		var want []byte
		for _, h := range tr.objects {
			want = append(want, h[:]...)
		}
		if !bytes.Equal(objs, want) {
			t.Fatalf("object list of %+v differs from a scan's in fresh memory", spec)
		}
		kept := c.scratch.kept()
		if len(kept) != 1 {
			t.Fatalf("%d scratch kept after %+v, want 1", len(kept), spec)
		}
		if first == nil {
			first = kept[0]
		} else if kept[0] != first {
			t.Fatalf("%+v was not built in the scratch the first build left", spec)
		}
	}
	image(Spec{Root: big, Prefix: "w", UID: 1000, GID: 1000})
	image(Spec{Root: small, Prefix: "w", UID: 1000, GID: 1000})
	image(Spec{Root: big, Prefix: "w", UID: 2000, GID: 2000}) // derived
	image(Spec{Root: other, UID: 70000, GID: 1})
	if _, err := c.image(ctx, Spec{Root: broken, Prefix: "w"}); !errors.As(err, new(*MissingError)) {
		t.Fatalf("image of a tree with an object missing: %v, want a MissingError", err)
	}
	image(Spec{Root: small, Prefix: "a/b", UID: 5, GID: 5})
	image(Spec{Root: big, Prefix: "v", UID: 1000, GID: 1000})
	image(Spec{Root: other, UID: 70001, GID: 2}) // derived, from an image built in between
	if b, d := c.stats.Builds.Load(), c.stats.Derived.Load(); b != 5 || d != 2 {
		t.Fatalf("%d built, %d derived; want 5 and 2", b, d)
	}
}

// TestScratchPoolBounds: the pool keeps what its builds leave, not a scratch larger
// than its limit, and once idle only the last one put back.
func TestScratchPoolBounds(t *testing.T) {
	p := &scratchPool{idle: 200 * time.Millisecond, limit: 1 << 20}
	a, b, c := p.get(), p.get(), p.get()
	a.image = make([]byte, 0, 4096)
	c.image = make([]byte, 0, 2<<20) // over the limit
	p.put(c)
	p.put(a)
	p.put(b)
	if kept := p.kept(); len(kept) != 2 || kept[0] != a || kept[1] != b {
		t.Fatalf("kept %d scratch, want a and b", len(kept))
	}
	if s := p.get(); s != b {
		t.Fatal("get did not return a kept scratch")
	} else {
		p.put(s)
	}
	for deadline := time.Now().Add(10 * time.Second); len(p.kept()) > 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("second scratch not dropped once the pool was idle")
		}
	}
	time.Sleep(300 * time.Millisecond) // another idle spell: the last one stays
	if kept := p.kept(); len(kept) != 1 || kept[0] != b {
		t.Fatalf("kept %d scratch once idle, want b, the last put back", len(kept))
	}
}

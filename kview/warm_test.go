package kview

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// TestWarmTrees: a new process's cache decodes the trees of the roots its images
// showed last, most recent first and no more than asked; a build after that reads no
// tree object of those roots and writes the image a cold build writes, in memory the
// warm-up faulted in (scratch.go); images whose records are unreadable, and trees whose
// objects have gone, are skipped.
func TestWarmTrees(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	old := fixture(t, s)
	recent := casstoretest.Build(t, s, map[string]casstoretest.Leaf{
		"go.mod":          casstoretest.File("module x\n"),
		"cmd/x/main.go":   casstoretest.File("package main\n"),
		"internal/a.go":   casstoretest.File("package internal\n"),
		"internal/b/b.go": casstoretest.File("package b\n"),
	})
	dir := t.TempDir()
	c := openCache(t, dir, s)
	used := time.Now().Add(-time.Hour)
	for _, root := range []casstore.Hash{old, recent} {
		img, err := c.image(ctx, Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000})
		if err != nil {
			t.Fatal(err)
		}
		used = used.Add(time.Minute) // recent was used last
		if err := os.Chtimes(img, used, used); err != nil {
			t.Fatal(err)
		}
	}
	// A new process finds both roots, recent first, and warms one: recent's 5 trees
	// (root, cmd, cmd/x, internal, internal/b), none of old's.
	c2 := openCache(t, dir, s)
	if got := c2.lastRoots; len(got) != 2 || got[0] != recent || got[1] != old {
		t.Fatalf("recent roots %v, want [%s %s]", got, recent.Short(), old.Short())
	}
	n, err := c2.WarmTrees(ctx, 1)
	if err != nil || n != 5 || c2.stats.TreesWarmed.Load() != 5 {
		t.Fatalf("warmed %d trees (%v), stats %d; want 5", n, err, c2.stats.TreesWarmed.Load())
	}
	// The first build's working memory is the process's already: a kept scratch that
	// laid out recent's image (9 inodes: 4 files, 5 directories), no image built.
	if kept := c2.scratch.kept(); len(kept) != 1 || kept[0].nodes.bytes() == 0 || cap(kept[0].inodes) < 9 || cap(kept[0].buf) == 0 {
		t.Fatalf("%d scratch kept after warming, want one with recent's image laid out", len(kept))
	}
	if b := c2.stats.Builds.Load(); b != 0 {
		t.Fatalf("warming built %d images", b)
	}
	spec := Spec{Root: recent, Prefix: "srv/other", UID: 70000, GID: 70000} // a build, not a derivation
	img, err := c2.image(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if r := c2.stats.TreesRead.Load(); r != 0 {
		t.Fatalf("a build of a warmed root read %d tree objects, want 0", r)
	}
	got, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, buildImage(t, s, spec)) {
		t.Fatal("image built from warmed trees differs from a cold build's")
	}
	if _, err := c2.image(ctx, Spec{Root: old, Prefix: "x", UID: 70000, GID: 70000}); err != nil {
		t.Fatal(err)
	}
	if r := c2.stats.TreesRead.Load(); r == 0 {
		t.Fatal("a root that was not warmed read no tree objects: the count means nothing")
	}

	// Unreadable records are skipped; a tree object gone costs that root's warm-up.
	if err := os.WriteFile(c.path(spec.Key(), ".json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	removeObject(t, s, recent)
	c3 := openCache(t, dir, s)
	if n, err := c3.WarmTrees(ctx, 5); err != nil || n == 0 {
		t.Fatalf("warm-up with a root gone: %d trees, %v; want old's trees", n, err)
	}
	if _, ok := c3.memo.get(old); !ok {
		t.Fatal("old's root tree not warmed")
	}

	// A cancelled warm-up says so.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	c4 := openCache(t, dir, s)
	if _, err := c4.WarmTrees(cctx, 5); err == nil {
		t.Fatal("a cancelled warm-up reported success")
	}
}

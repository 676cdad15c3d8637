package snapshotter_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// TestBranchLiveSnapshot: a mounted snapshot with 100 changed files is branched 3
// ways while mounted; the branches hold exactly its changes at that moment, later
// writes stay out of them, and its own commit on removal is its own changes, as if
// no branch had been taken.
func TestBranchLiveSnapshot(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	root := ingestFiles(t, e.store, sourceFiles)
	mounts, err := e.sn.Prepare(ctx, "c1", "layer1", labels(binding.LabelFork, root.String(), binding.LabelWorkdir, "/work"))
	if err != nil {
		t.Fatal(err)
	}
	own := forkOf(t, e.db, "c1")
	var want casstore.Hash
	withMounted(t, mounts, func(dir string) {
		for i := 0; i < 100; i++ {
			writeFiles(t, dir, map[string]string{fmt.Sprintf("work/gen/%02d/f%03d.txt", i%10, i): fmt.Sprintf("file %d\n", i)})
		}
		if err := os.Remove(filepath.Join(dir, "work/src/old.js")); err != nil {
			t.Fatal(err)
		}
		writeFiles(t, dir, map[string]string{"etc/outside": "not in the workdir"})

		var frozen, thawed int
		res, err := e.sn.Branch(ctx, snapshotter.BranchRequest{
			Rootfs: mounts, Count: 3, Label: "try", Labels: map[string]string{"k": "v"},
			Freeze: func(context.Context) (func() error, error) {
				frozen++
				return func() error { thawed++; return nil }, nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		if frozen != 1 || thawed != 1 {
			t.Fatalf("froze %d times, thawed %d times", frozen, thawed)
		}
		if res.Key != "c1" || res.ForkID != own.ID || res.Base != root || len(res.Forks) != 3 || res.Stats.Files != 100 {
			t.Fatalf("result %+v", res)
		}
		// The branch is the workdir as the container saw it, read through the overlay.
		if merged := dirRoot(t, e, filepath.Join(dir, "work")); merged != res.Root {
			t.Fatalf("branch root %s, merged workdir %s", res.Root, merged)
		}
		got := changes(t, e.store, root, res.Root)
		if len(got) != 101 || got[0] != "A gen/00/f000.txt" || !strings.Contains(strings.Join(got, ","), "D src/old.js") {
			t.Fatalf("branch changes (%d): %v", len(got), got)
		}
		for i, f := range res.Forks {
			stored := forkOf(t, e.db, f.ID)
			if stored.Root != res.Root || stored.Base != root || stored.Label != fmt.Sprintf("try-%d", i+1) ||
				stored.Labels["k"] != "v" || stored.Labels[snapshotter.ForkLabelBranchOf] != "c1" {
				t.Fatalf("branch %d: %+v", i, stored)
			}
		}
		// The container's own binding is untouched.
		if f := forkOf(t, e.db, own.ID); f.Root != root {
			t.Fatalf("own fork moved to %s", f.Root)
		}
		// Writes after the branch.
		writeFiles(t, dir, map[string]string{"work/after.txt": "later\n", "work/gen/00/f000.txt": "changed later\n"})

		// A second branch sees them; the first branches do not move.
		res2, err := e.sn.Branch(ctx, snapshotter.BranchRequest{Key: "c1"})
		if err != nil {
			t.Fatal(err)
		}
		if d := changes(t, e.store, res.Root, res2.Root); strings.Join(d, ",") != "A after.txt,M gen/00/f000.txt" {
			t.Fatalf("second branch vs first: %v", d)
		}
		for _, f := range res.Forks {
			if forkOf(t, e.db, f.ID).Root != res.Root {
				t.Fatal("a branch moved")
			}
		}
		want = dirRoot(t, e, filepath.Join(dir, "work"))
	})
	// The snapshot's commit on removal: its own changes, all of them.
	if err := e.sn.Remove(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	if f := forkOf(t, e.db, own.ID); f.Root != want || len(changes(t, e.store, root, f.Root)) != 102 {
		t.Fatalf("own commit %s, want %s", f.Root, want)
	}
}

// dirRoot ingests a directory (a merged overlay) as it is now.
func dirRoot(t *testing.T, e *env, dir string) casstore.Hash {
	t.Helper()
	h, _, err := ingest.Dir(context.Background(), e.store, dir, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestBranchRefusals(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	if _, err := e.sn.Prepare(ctx, "plain", "layer1"); err != nil {
		t.Fatal(err)
	}
	root := ingestFiles(t, e.store, sourceFiles)
	if _, err := e.sn.Prepare(ctx, "late", "layer1", labels(binding.LabelLateBind, "true", binding.LabelWorkdir, "/app")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.sn.Prepare(ctx, "c1", "layer1", labels(binding.LabelFork, root.String())); err != nil {
		t.Fatal(err)
	}
	freezeFails := func(context.Context) (func() error, error) {
		return nil, fmt.Errorf("no freezer: %w", errdefs.ErrUnavailable)
	}
	for _, c := range []struct {
		req  snapshotter.BranchRequest
		is   func(error) bool
		text string
	}{
		{snapshotter.BranchRequest{Key: "nope"}, errdefs.IsNotFound, "nope"},
		{snapshotter.BranchRequest{Key: "plain"}, errdefs.IsFailedPrecondition, "no source fork"},
		{snapshotter.BranchRequest{Key: "late"}, errdefs.IsFailedPrecondition, "waits for its fork"},
		{snapshotter.BranchRequest{Key: "layer1"}, errdefs.IsFailedPrecondition, "layer1"},
		{snapshotter.BranchRequest{Key: "c1", Count: 65}, errdefs.IsInvalidArgument, "count"},
		{snapshotter.BranchRequest{Key: "c1", Freeze: freezeFails}, errdefs.IsUnavailable, "no freezer"},
	} {
		_, err := e.sn.Branch(ctx, c.req)
		if err == nil || !c.is(err) || !strings.Contains(err.Error(), c.text) {
			t.Errorf("branch %+v: %v", c.req.Key, err)
		}
	}
	list, _ := e.db.List(ctx)
	if len(list) != 1 {
		t.Fatalf("refused branches left forks: %d records", len(list))
	}
	for _, k := range []string{"c1", "late", "plain"} {
		if err := e.sn.Remove(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
}

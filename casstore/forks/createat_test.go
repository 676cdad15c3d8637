package forks

import (
	"context"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// TestCreateAt: branches start at the given root with their base in the history, all
// in one transaction; a request id dedups as Create's does; a bad request writes none.
func TestCreateAt(t *testing.T) {
	ctx := context.Background()
	d, c, _ := openTest(t)
	reqs := []CreateRequest{
		{Base: root("start"), Label: "b-1", Labels: map[string]string{"k": "v"}},
		{Base: root("start"), Label: "b-2", RequestID: "rid-2"},
	}
	got, err := d.CreateAt(ctx, reqs, root("now"), "branch of c1")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID == got[1].ID {
		t.Fatalf("created %+v", got)
	}
	for i, f := range got {
		if f.Base != root("start") || f.Root != root("now") || f.Label != reqs[i].Label ||
			len(f.History) != 1 || f.History[0].Root != root("start") || f.History[0].Reason != "branch of c1" || !f.Created.Equal(c.Now()) {
			t.Fatalf("branch %d: %+v", i, f)
		}
		stored, err := d.Get(ctx, f.ID)
		if err != nil || stored.Root != root("now") {
			t.Fatalf("stored branch %d: %+v %v", i, stored, err)
		}
	}
	if got[0].Labels["k"] != "v" || got[1].Labels[RequestIDLabel] != "rid-2" {
		t.Fatalf("labels %v %v", got[0].Labels, got[1].Labels)
	}
	// A retried request id returns the first fork, whatever root the retry reached.
	again, err := d.CreateAt(ctx, []CreateRequest{{Base: root("start"), RequestID: "rid-2"}}, root("later"), "retry")
	if err != nil || again[0].ID != got[1].ID || again[0].Root != root("now") {
		t.Fatalf("retry: %+v %v", again, err)
	}
	// One bad request: nothing is written.
	before, _ := d.List(ctx)
	_, err = d.CreateAt(ctx, []CreateRequest{{Base: root("start")}, {Base: root("start"), TTL: -1}}, root("x"), "")
	if !errdefs.IsInvalidArgument(err) {
		t.Fatalf("negative ttl: %v", err)
	}
	if _, err := d.CreateAt(ctx, []CreateRequest{{Base: root("start")}}, casstore.Hash{}, ""); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("zero root: %v", err)
	}
	after, _ := d.List(ctx)
	if len(after) != len(before) {
		t.Fatalf("a refused CreateAt wrote %d forks", len(after)-len(before))
	}
	// Same base and root: a plain fork, no history.
	same, err := d.CreateAt(ctx, []CreateRequest{{Base: root("start")}}, root("start"), "nothing changed")
	if err != nil || same[0].Root != root("start") || len(same[0].History) != 0 {
		t.Fatalf("unchanged branch: %+v %v", same, err)
	}
}

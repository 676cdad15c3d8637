package forks

import (
	"context"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// TestCreateIsIdempotentPerRequest: a retried create (same request id) returns the
// first fork; the id travels as a label, as it does over the API; a removed fork's
// id is forgotten.
func TestCreateIsIdempotentPerRequest(t *testing.T) {
	db, _, _ := openTest(t)
	ctx := context.Background()
	a, err := db.Create(ctx, CreateRequest{Base: root("a"), RequestID: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := db.Create(ctx, CreateRequest{Base: root("a"), Labels: map[string]string{RequestIDLabel: "r1"}})
	if err != nil || b.ID != a.ID {
		t.Fatalf("retry made %v, %v; want fork %s again", b, err, a.ID)
	}
	if _, err := db.Create(ctx, CreateRequest{Base: root("b"), RequestID: "r1"}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("request id reused for another base: %v, want already exists", err)
	}
	if list, _ := db.List(ctx); len(list) != 1 {
		t.Errorf("%d forks, want 1", len(list))
	}
	if err := db.Remove(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	c, err := db.Create(ctx, CreateRequest{Base: root("a"), RequestID: "r1"})
	if err != nil || c.ID == a.ID {
		t.Errorf("create after removal: %v, %v; want a new fork", c, err)
	}
}

// TestGuardRefusesCollectedRoot: with a guard, a record naming a root that is not
// stored is refused, under the store's lock.
func TestGuardRefusesCollectedRoot(t *testing.T) {
	db, _, _ := openTest(t)
	s := casstoretest.NewStore(t)
	db.SetGuard(s)
	ctx := context.Background()
	stored, err := s.PutBytes(nil)
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "f", Hash: stored}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := db.Create(ctx, CreateRequest{Base: h})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Create(ctx, CreateRequest{Base: root("gone")}); !errdefs.IsNotFound(err) {
		t.Errorf("create of an unstored root: %v, want not found", err)
	}
	if _, err := db.Advance(ctx, f.ID, h, root("gone"), "test"); !errdefs.IsNotFound(err) {
		t.Errorf("advance to an unstored root: %v, want not found", err)
	}
	if err := db.Pin("p", root("gone")); !errdefs.IsNotFound(err) {
		t.Errorf("pin of an unstored root: %v, want not found", err)
	}
}

package fsck

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// corrupt overwrites an object's file with other bytes, as bit rot or tampering would.
func corrupt(t testing.TB, s *casstore.Store, h casstore.Hash, data string) {
	t.Helper()
	if err := os.WriteFile(s.Path(h), []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// fixture: a live root with a file, an executable and a subdirectory, plus garbage.
func fixture(t *testing.T) (*casstore.Store, casstore.Hash, map[string]casstore.Hash) {
	s := casstoretest.NewStore(t)
	hs := map[string]casstore.Hash{
		"a":       casstoretest.Put(t, s, "content of a"),
		"b":       casstoretest.Put(t, s, "content of b"),
		"garbage": casstoretest.Put(t, s, "unreachable"),
	}
	hs["sub"] = casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeExec, Name: "b", Hash: hs["b"]})
	root := casstoretest.Tree(t, s,
		casstore.Entry{Mode: casstore.ModeFile, Name: "a", Hash: hs["a"]},
		casstore.Entry{Mode: casstore.ModeDir, Name: "sub", Hash: hs["sub"]},
	)
	return s, root, hs
}

func TestCheckHealthyStore(t *testing.T) {
	s, root, _ := fixture(t)
	r, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.Healthy() || r.Objects != 5 || r.Roots != 1 {
		t.Fatalf("report %+v", r)
	}
	var want int64
	_ = s.Walk(func(h casstore.Hash, _ string) error { n, _ := s.Size(h); want += n; return nil })
	if r.Bytes != want {
		t.Fatalf("bytes %d, want %d", r.Bytes, want)
	}
}

func TestCheckFindsCorruptObjects(t *testing.T) {
	s, root, hs := fixture(t)
	// Corrupt a blob after a verified read: fsck must not trust the read cache.
	if f, err := s.Open(hs["a"]); err != nil {
		t.Fatal(err)
	} else {
		f.Close()
	}
	corrupt(t, s, hs["a"], "rotten")
	corrupt(t, s, hs["garbage"], "also rotten")
	r, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{Workers: 3})
	if err != nil {
		t.Fatal(err)
	}
	if r.Healthy() || len(r.Bad) != 2 {
		t.Fatalf("bad %v", r.Bad)
	}
	got := map[casstore.Hash]BadObject{}
	for _, b := range r.Bad {
		got[b.Hash] = b
	}
	if b := got[hs["a"]]; b.Got != casstore.Sum([]byte("rotten")) || b.Path != s.Path(hs["a"]) || !errors.Is(b.Err, errdefs.ErrDataLoss) || b.Quarantined != "" {
		t.Fatalf("bad object reported as %+v", b)
	}
	if _, err := os.Stat(s.Path(hs["a"])); err != nil {
		t.Fatal("without --quarantine the object must stay in place")
	}
	if len(r.Missing) != 0 {
		t.Fatalf("missing %v", r.Missing)
	}
}

func TestQuarantine(t *testing.T) {
	s, root, hs := fixture(t)
	corrupt(t, s, hs["sub"], "a tree no more")
	corrupt(t, s, hs["garbage"], "rotten garbage")
	r, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{Quarantine: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Bad) != 2 {
		t.Fatalf("bad %v", r.Bad)
	}
	qdir := filepath.Join(s.Root(), casstore.QuarantineDirName)
	for _, b := range r.Bad {
		if filepath.Dir(b.Quarantined) != qdir || !strings.HasPrefix(filepath.Base(b.Quarantined), b.Hash.String()+".") {
			t.Fatalf("quarantined to %q", b.Quarantined)
		}
		if _, err := os.Stat(b.Path); !os.IsNotExist(err) {
			t.Fatalf("%s still in the store", b.Hash)
		}
		data, err := os.ReadFile(b.Quarantined)
		if err != nil || casstore.Sum(data) != b.Got {
			t.Fatalf("quarantined copy of %s lost its bytes: %v", b.Hash, err)
		}
	}
	// The quarantined tree was reachable: now it is missing.
	if len(r.Missing) != 1 || r.Missing[0].Hash != hs["sub"] || !r.Missing[0].Tree || r.Missing[0].Path != "sub" {
		t.Fatalf("missing %v", r.Missing)
	}
	// The store is consistent again apart from what is missing.
	r2, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.Bad) != 0 || r2.Objects != 3 {
		t.Fatalf("second check %+v", r2)
	}
}

func TestQuarantineSparesRepairedObject(t *testing.T) {
	s, root, hs := fixture(t)
	corrupt(t, s, hs["a"], "rotten")
	testHookBeforeQuarantine = func() {
		// A writer puts the right bytes back before the quarantine takes the lock.
		if err := os.WriteFile(s.Path(hs["a"]), []byte("content of a"), 0o644); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() { testHookBeforeQuarantine = nil })
	r, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{Quarantine: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Bad) != 0 || !r.Healthy() {
		t.Fatalf("report %+v", r)
	}
	if _, err := os.Stat(s.Path(hs["a"])); err != nil {
		t.Fatal("a repaired object was quarantined")
	}
}

func TestCheckReachability(t *testing.T) {
	s := casstoretest.NewStore(t)
	missingBlob := casstore.Sum([]byte("never stored"))
	missingTree := casstore.Sum([]byte("never stored either"))
	child := casstoretest.Put(t, s, "child")
	// A tree LunarFS accepts and Tidepool refuses.
	odd := casstoretest.RawTree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "..", Hash: child})
	junk := casstoretest.Put(t, s, "\x01\x02") // not a tree at all
	root := casstoretest.Tree(t, s,
		casstore.Entry{Mode: casstore.ModeFile, Name: "gone", Hash: missingBlob},
		casstore.Entry{Mode: casstore.ModeDir, Name: "gonedir", Hash: missingTree},
		casstore.Entry{Mode: casstore.ModeDir, Name: "junk", Hash: junk},
		casstore.Entry{Mode: casstore.ModeDir, Name: "odd", Hash: odd},
		casstore.Entry{Mode: casstore.ModeFile, Name: "empty", Hash: casstore.EmptyHash}, // never missing
	)
	r, err := Check(context.Background(), s, nil, Options{Roots: []casstore.Hash{root}})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Bad) != 0 || r.Healthy() {
		t.Fatalf("report %+v", r)
	}
	if len(r.Missing) != 2 || len(r.Undecodable) != 1 || len(r.Unreadable) != 1 {
		t.Fatalf("missing %v undecodable %v unreadable %v", r.Missing, r.Undecodable, r.Unreadable)
	}
	if r.Undecodable[0].Path != "odd" || r.Unreadable[0].Path != "junk" {
		t.Fatalf("undecodable %v unreadable %v", r.Undecodable, r.Unreadable)
	}
	for _, p := range r.Missing {
		if (p.Path == "gone") == p.Tree || (p.Path == "gone" && p.Hash != missingBlob) || (p.Path == "gonedir" && p.Hash != missingTree) {
			t.Fatalf("missing reported as %+v", p)
		}
	}
}

func TestCheckManyObjectsConcurrently(t *testing.T) {
	s := casstoretest.NewStore(t)
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	var ents []casstore.Entry
	for i := 0; i < 500; i++ {
		h, err := b.PutBytes([]byte(strings.Repeat(fmt.Sprint(i), 100)))
		if err != nil {
			t.Fatal(err)
		}
		ents = append(ents, casstore.Entry{Mode: casstore.ModeFile, Name: fmt.Sprint(i), Hash: h})
	}
	root, err := b.WriteTree(ents)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	corrupt(t, s, ents[7].Hash, "x")
	corrupt(t, s, ents[300].Hash, "y")
	r, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{Workers: 4})
	if err != nil {
		t.Fatal(err)
	}
	if r.Objects != 501 || len(r.Bad) != 2 {
		t.Fatalf("objects %d bad %v", r.Objects, r.Bad)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Check(ctx, s, casstoretest.Roots{root}, Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled check: %v", err)
	}
}

// TestCheckReconcilesSizeIndex: the size index entry of an object deleted by hand (an
// entry also means "present") or overwritten with other bytes is dropped; sound
// objects keep theirs.
func TestCheckReconcilesSizeIndex(t *testing.T) {
	s, root, hs := fixture(t)
	if err := os.Remove(s.Path(hs["garbage"])); err != nil {
		t.Fatal(err)
	}
	corrupt(t, s, hs["b"], "other, longer bytes")
	r, err := Check(context.Background(), s, casstoretest.Roots{root}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r.SizesForgotten != 2 {
		t.Fatalf("forgot %d size entries, want 2", r.SizesForgotten)
	}
	if err := s.RefreshSizes(); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{"garbage": false, "b": false, "a": true} {
		if _, ok := s.KnownSize(hs[name]); ok != want {
			t.Errorf("%s: size known %v, want %v", name, ok, want)
		}
	}
}

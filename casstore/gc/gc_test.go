package gc

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// build stores a tree of regular files (path -> content) and returns its root.
func build(t testing.TB, s *casstore.Store, files map[string]string) casstore.Hash {
	t.Helper()
	return casstoretest.Build(t, s, casstoretest.Files(files))
}

// age sets an object's mtime in the past, as if it had been written long ago.
func age(t testing.TB, s *casstore.Store, hs ...casstore.Hash) {
	t.Helper()
	old := time.Now().Add(-3 * time.Hour)
	for _, h := range hs {
		if err := os.Chtimes(s.Path(h), old, old); err != nil {
			t.Fatal(err)
		}
	}
}

func ageAll(t testing.TB, s *casstore.Store) {
	t.Helper()
	err := s.Walk(func(h casstore.Hash, _ string) error { age(t, s, h); return nil })
	if err != nil {
		t.Fatal(err)
	}
}

func objects(t testing.TB, s *casstore.Store) map[casstore.Hash]bool {
	t.Helper()
	out := map[casstore.Hash]bool{}
	if err := s.Walk(func(h casstore.Hash, _ string) error { out[h] = true; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// openForkDB opens a fork database in a temporary directory, closed when the test ends.
func openForkDB(t testing.TB) *forks.DB {
	t.Helper()
	db, err := forks.OpenDB(filepath.Join(t.TempDir(), "forks.db"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// assertComplete checks that every object reachable from rs is still in the store.
func assertComplete(t testing.TB, s *casstore.Store, rs ...casstore.Hash) *Marks {
	t.Helper()
	m, err := Mark(context.Background(), s, rs)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Missing) > 0 || len(m.Unreadable) > 0 {
		t.Fatalf("reachable objects lost: missing %v unreadable %v", m.Missing, m.Unreadable)
	}
	return m
}

func TestCollectSweepsOnlyUnreachable(t *testing.T) {
	s := casstoretest.NewStore(t)
	live := build(t, s, map[string]string{"a.txt": "a", "src/main.go": "main", "src/lib/x.go": "x", "shared": "s"})
	extra := build(t, s, map[string]string{"snap/file": "snapshot"})
	dead := build(t, s, map[string]string{"old/gone.txt": "gone", "shared": "s", "bye": "bye"})
	garbage := casstoretest.Put(t, s, strings.Repeat("g", 1000))
	ageAll(t, s)
	before := objects(t, s)

	res, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{Roots: []casstore.Hash{extra}})
	if err != nil {
		t.Fatal(err)
	}
	after := objects(t, s)
	m := assertComplete(t, s, live, extra)
	for h := range after {
		if !m.Has(h) {
			t.Errorf("unreachable object %s survived", h)
		}
	}
	for _, h := range []casstore.Hash{dead, garbage, casstore.Sum([]byte("gone")), casstore.Sum([]byte("bye"))} {
		if after[h] {
			t.Errorf("garbage %s survived", h)
		}
	}
	if !after[casstore.Sum([]byte("s"))] {
		t.Error("a blob shared by a live and a dead tree was swept")
	}
	// The size index forgets what was swept (an entry also means "present") and
	// keeps what stays.
	if err := s.RefreshSizes(); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.KnownSize(garbage); ok {
		t.Error("the size index still knows a swept object")
	}
	if n, ok := s.KnownSize(casstore.Sum([]byte("main"))); !ok || n != 4 {
		t.Errorf("the size index lost a live object: %d, %v", n, ok)
	}
	// dead root, old/, gone.txt, bye and the garbage blob.
	if res.Swept != len(before)-len(after) || res.Swept != 5 {
		t.Errorf("swept %d, store lost %d objects, want 5", res.Swept, len(before)-len(after))
	}
	if res.BytesFreed < 1000 || res.Roots != 2 || res.Marked != m.Len() || res.Young != 0 {
		t.Errorf("result %+v", res)
	}

	// A second collection finds nothing to do.
	res, err = Collect(context.Background(), s, casstoretest.Roots{live}, Options{Roots: []casstore.Hash{extra}})
	if err != nil || res.Swept != 0 {
		t.Fatalf("second run: %+v, %v", res, err)
	}
}

func TestCollectGraceAndDryRun(t *testing.T) {
	s := casstoretest.NewStore(t)
	live := build(t, s, map[string]string{"keep": "k"})
	old := casstoretest.Put(t, s, "old garbage")
	age(t, s, old)
	fresh := casstoretest.Put(t, s, "fresh garbage") // written just now: may belong to a running commit

	dry, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if !dry.DryRun || dry.Swept != 1 || dry.Young != 1 || dry.BytesFreed != int64(len("old garbage")) {
		t.Fatalf("dry run: %+v", dry)
	}
	if got := objects(t, s); !got[old] || !got[fresh] {
		t.Fatal("dry run deleted objects")
	}

	res, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Swept != dry.Swept || res.BytesFreed != dry.BytesFreed || res.Young != 1 {
		t.Fatalf("real run %+v differs from dry run %+v", res, dry)
	}
	got := objects(t, s)
	if got[old] || !got[fresh] {
		t.Fatalf("default grace: old kept %v, fresh kept %v", got[old], got[fresh])
	}

	// No grace: fresh garbage goes too.
	if _, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{Grace: -1}); err != nil {
		t.Fatal(err)
	}
	if objects(t, s)[fresh] {
		t.Fatal("negative grace kept a fresh unreachable object")
	}
	assertComplete(t, s, live)
}

// TestMarkSharedNamespace: one hash used both as a file and as a tree. Whichever use
// the walk meets first, the tree's children must be marked.
func TestMarkSharedNamespace(t *testing.T) {
	for _, fileFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("fileFirst=%v", fileFirst), func(t *testing.T) {
			s := casstoretest.NewStore(t)
			child := casstoretest.Put(t, s, "only reachable through the tree")
			sub := casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "c", Hash: child})
			fileName, dirName := "a", "z"
			if !fileFirst {
				fileName, dirName = "z", "a"
			}
			// Both roots hold the object: once as a file's content, once as a directory.
			r1 := casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: fileName, Hash: sub})
			r2 := casstoretest.Tree(t, s,
				casstore.Entry{Mode: casstore.ModeFile, Name: fileName, Hash: sub},
				casstore.Entry{Mode: casstore.ModeDir, Name: dirName, Hash: sub},
			)
			ageAll(t, s)
			for _, order := range [][]casstore.Hash{{r1, r2}, {r2, r1}} {
				if _, err := Collect(context.Background(), s, casstoretest.Roots(order), Options{}); err != nil {
					t.Fatal(err)
				}
				if !objects(t, s)[child] {
					t.Fatal("the child of a tree first seen as a file was swept")
				}
			}
			assertComplete(t, s, r1, r2)
		})
	}
}

func TestCollectReportsMissingAndStillSweeps(t *testing.T) {
	s := casstoretest.NewStore(t)
	live := build(t, s, map[string]string{"a": "a", "d/b": "b", "e/c": "c"})
	garbage := casstoretest.Put(t, s, "garbage")
	ageAll(t, s)
	rt, err := s.ReadTree(live)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := rt.Lookup("a")
	d, _ := rt.Lookup("d")
	for _, h := range []casstore.Hash{a.Hash, d.Hash} {
		if err := os.Remove(s.Path(h)); err != nil {
			t.Fatal(err)
		}
	}
	res, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Missing) != 2 {
		t.Fatalf("missing %v, want the blob a and the tree d", res.Missing)
	}
	got := map[string]Problem{}
	for _, p := range res.Missing {
		got[p.Path] = p
	}
	if p := got["a"]; p.Hash != a.Hash || p.Tree || p.Root != live {
		t.Errorf("missing blob reported as %+v", p)
	}
	if p := got["d"]; p.Hash != d.Hash || !p.Tree {
		t.Errorf("missing tree reported as %+v", p)
	}
	// The garbage goes, and so does d's child: with d gone nothing reaches it.
	if objects(t, s)[garbage] || res.Swept != 2 {
		t.Fatalf("sweep did not run: %+v", res)
	}
	if !objects(t, s)[casstore.Sum([]byte("c"))] {
		t.Fatal("reachable blob swept")
	}
}

func TestCollectRefusesWhenTreeCorrupt(t *testing.T) {
	s := casstoretest.NewStore(t)
	live := build(t, s, map[string]string{"d/deep/x": "x"})
	garbage := casstoretest.Put(t, s, "garbage")
	ageAll(t, s)
	rt, _ := s.ReadTree(live)
	d, _ := rt.Lookup("d")
	if err := os.WriteFile(s.Path(d.Hash), []byte("not the tree any more"), 0o644); err != nil {
		t.Fatal(err)
	}
	age(t, s, d.Hash)
	before := objects(t, s)
	_, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{})
	if !errors.Is(err, ErrUnreadableTrees) || !strings.Contains(err.Error(), d.Hash.String()) {
		t.Fatalf("got %v, want ErrUnreadableTrees naming %s", err, d.Hash)
	}
	if after := objects(t, s); len(after) != len(before) || !after[garbage] {
		t.Fatal("objects were swept although a reachable tree is unreadable")
	}
}

func TestCollectKeepsChildrenOfUndecodableTrees(t *testing.T) {
	s := casstoretest.NewStore(t)
	child := casstoretest.Put(t, s, "child of a LunarFS tree with an unsafe name")
	grandchild := casstoretest.Put(t, s, "grandchild")
	sub := casstoretest.RawTree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "g", Hash: grandchild})
	// LunarFS accepts names like "../x" and unsorted entries; Tidepool's codec does not.
	odd := casstoretest.RawTree(t, s,
		casstore.Entry{Mode: casstore.ModeFile, Name: "../x", Hash: child},
		casstore.Entry{Mode: casstore.ModeDir, Name: "a", Hash: sub},
	)
	live := casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeDir, Name: "odd", Hash: odd})
	ageAll(t, s)
	res, err := Collect(context.Background(), s, casstoretest.Roots{live}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Undecodable) != 1 || res.Undecodable[0].Hash != odd || res.Undecodable[0].Path != "odd" {
		t.Fatalf("undecodable %v", res.Undecodable)
	}
	got := objects(t, s)
	if !got[child] || !got[grandchild] || !got[sub] || res.Swept != 0 {
		t.Fatalf("children of an undecodable tree swept (%+v)", res)
	}
}

func TestCollectSweepsStaleTemp(t *testing.T) {
	s := casstoretest.NewStore(t)
	h := build(t, s, map[string]string{"x": "x"})
	stale := s.Path(h)[:len(s.Path(h))-10] + "0000000000.tmp" // a LunarFS writer's leftover
	if err := os.WriteFile(stale, []byte("partial"), 0o644); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-2 * time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	res, err := Collect(context.Background(), s, casstoretest.Roots{h}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.TempSwept != 1 {
		t.Fatalf("temp swept %d", res.TempSwept)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatal("stale temp file kept")
	}
}

func TestCollectWithForkDB(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	db := openForkDB(t)
	base := build(t, s, map[string]string{"f": "v0"})
	f, err := db.Create(ctx, forks.CreateRequest{Base: base, Label: "w"})
	if err != nil {
		t.Fatal(err)
	}
	v1 := build(t, s, map[string]string{"f": "v1"})
	v2 := build(t, s, map[string]string{"f": "v2"})
	if _, err := db.Advance(ctx, f.ID, base, v1, "commit"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Advance(ctx, f.ID, v1, v2, "commit"); err != nil {
		t.Fatal(err)
	}
	pinned := build(t, s, map[string]string{"p": "pinned"})
	if err := db.Pin("release", pinned); err != nil {
		t.Fatal(err)
	}
	ageAll(t, s)
	if res, err := Collect(ctx, s, db, Options{}); err != nil || res.Swept != 0 {
		t.Fatalf("base, history, root and pin must all survive: %+v, %v", res, err)
	}
	assertComplete(t, s, base, v1, v2, pinned)

	if err := db.Remove(ctx, f.ID); err != nil {
		t.Fatal(err)
	}
	if err := db.Unpin("release"); err != nil {
		t.Fatal(err)
	}
	res, err := Collect(ctx, s, db, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Swept != 8 || len(objects(t, s)) != 0 {
		t.Fatalf("after removing the fork and the pin: %+v, %d objects left", res, len(objects(t, s)))
	}
}

// TestCollectConcurrentWithCommits runs collections while writers commit new trees
// that reuse old unreachable objects and move forks to them. Every fork must stay
// complete: an old object a writer picked up is refreshed by its batch, and GC
// re-checks mtimes under the exclusive lock.
func TestCollectConcurrentWithCommits(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	db := openForkDB(t)
	const pool = 200
	var old []string
	for i := 0; i < pool; i++ {
		old = append(old, fmt.Sprintf("old object %d", i))
		casstoretest.Put(t, s, old[i])
	}
	ageAll(t, s) // all unreachable and old: fair game unless a writer reuses them
	const writers = 3
	ids := make([]string, writers)
	for i := range ids {
		f, err := db.Create(ctx, forks.CreateRequest{Base: casstore.EmptyHash})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = f.ID
	}

	stop := make(chan struct{})
	var gcErr error
	var gcRuns int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := Collect(ctx, s, db, Options{}); err != nil {
				gcErr = err
				return
			}
			gcRuns++
		}
	}()
	var werr = make([]error, writers)
	var ww sync.WaitGroup
	for w := 0; w < writers; w++ {
		ww.Add(1)
		go func(w int) {
			defer ww.Done()
			rng := rand.New(rand.NewSource(int64(w)))
			for i := 0; i < 40; i++ {
				files := map[string]string{}
				for j := 0; j < 5; j++ {
					files[fmt.Sprintf("d%d/f%d", j%2, j)] = old[rng.Intn(pool)]
				}
				b, err := s.Begin()
				if err != nil {
					werr[w] = err
					return
				}
				root, err := casstoretest.Stage(b, casstoretest.Files(files))
				if err == nil {
					err = b.Commit()
				} else {
					b.Abort()
				}
				if err != nil {
					werr[w] = err
					return
				}
				if _, err := db.Advance(ctx, ids[w], casstore.Hash{}, root, "commit"); err != nil {
					werr[w] = err
					return
				}
			}
		}(w)
	}
	ww.Wait()
	close(stop)
	wg.Wait()
	if gcErr != nil {
		t.Fatal(gcErr)
	}
	for _, err := range werr {
		if err != nil {
			t.Fatal(err)
		}
	}
	live, err := db.LiveRoots()
	if err != nil {
		t.Fatal(err)
	}
	assertComplete(t, s, live...)
	t.Logf("%d collections ran during the commits", gcRuns)
}

func withHook(t *testing.T, fn func()) {
	testHookBeforeLock = fn
	t.Cleanup(func() { testHookBeforeLock = nil })
}

// TestCollectKeepsObjectsReusedDuringSweep: a commit that reuses an old unreachable
// object after GC listed it as a candidate, and whose fork moves only after GC ends,
// keeps that object (its batch refreshed the mtime, which GC re-checks under lock).
func TestCollectKeepsObjectsReusedDuringSweep(t *testing.T) {
	s := casstoretest.NewStore(t)
	reused := casstoretest.Put(t, s, "old content a commit is about to reuse")
	other := casstoretest.Put(t, s, "old garbage")
	ageAll(t, s)
	var newRoot casstore.Hash
	withHook(t, func() {
		newRoot = build(t, s, map[string]string{"f": "old content a commit is about to reuse"})
	})
	res, err := Collect(context.Background(), s, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	got := objects(t, s)
	if !got[reused] || got[other] || res.Swept != 1 {
		t.Fatalf("reused kept %v, garbage kept %v, result %+v", got[reused], got[other], res)
	}
	assertComplete(t, s, newRoot) // the fork can now move to newRoot safely
}

// TestCollectMarksRootsThatAppearDuringSweep: a fork moved (here, reverted to an old
// root whose objects are all old) between the mark phase and the sweep keeps its tree.
func TestCollectMarksRootsThatAppearDuringSweep(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	db := openForkDB(t)
	oldRoot := build(t, s, map[string]string{"dir/file": "old revision"})
	cur := build(t, s, map[string]string{"dir/file": "current"})
	f, err := db.Create(ctx, forks.CreateRequest{Base: cur})
	if err != nil {
		t.Fatal(err)
	}
	ageAll(t, s)
	withHook(t, func() {
		if _, err := db.Advance(ctx, f.ID, cur, oldRoot, "revert"); err != nil {
			t.Error(err)
		}
	})
	if _, err := Collect(ctx, s, db, Options{}); err != nil {
		t.Fatal(err)
	}
	assertComplete(t, s, oldRoot, cur)
}

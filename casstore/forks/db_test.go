package forks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

func root(s string) casstore.Hash { return casstore.Sum([]byte(s)) }

// clock is a fake time source that moves only when told.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func openTest(t *testing.T) (*DB, *clock, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "sub", "forks.db")
	d, err := OpenDB(path, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	c := &clock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	d.now = c.Now
	return d, c, path
}

func TestCreateGetListRemove(t *testing.T) {
	ctx := context.Background()
	d, c, _ := openTest(t)
	a, err := d.Create(ctx, CreateRequest{Base: root("a"), Label: "feature", TTL: time.Hour, Labels: map[string]string{"team": "x"}})
	if err != nil {
		t.Fatal(err)
	}
	if !IsID(a.ID) || a.Base != root("a") || a.Root != root("a") || a.Label != "feature" || time.Duration(a.TTL) != time.Hour ||
		!a.Created.Equal(c.Now()) || a.Labels["team"] != "x" {
		t.Fatalf("created %+v", a)
	}
	c.Add(time.Second)
	b, err := d.Create(ctx, CreateRequest{Base: root("b")})
	if err != nil {
		t.Fatal(err)
	}
	if a.ID == b.ID {
		t.Fatal("two forks share an id")
	}

	for _, ref := range []string{a.ID, "feature"} {
		got, err := d.Get(ctx, ref)
		if err != nil {
			t.Fatalf("get %q: %v", ref, err)
		}
		if got.ID != a.ID || got.Labels["team"] != "x" || !got.Created.Equal(a.Created) {
			t.Fatalf("get %q = %+v", ref, got)
		}
	}
	// b has no label: neither "" nor an unknown label may find it.
	for _, ref := range []string{"", "nope", "0123456789abcdef"} {
		if _, err := d.Get(ctx, ref); !errdefs.IsNotFound(err) {
			t.Fatalf("get %q: %v, want not found", ref, err)
		}
	}

	list, err := d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].ID != a.ID || list[1].ID != b.ID {
		t.Fatalf("list not oldest first: %v", list)
	}

	if err := d.Remove(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Get(ctx, a.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("get after remove: %v", err)
	}
	if err := d.Remove(ctx, a.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("second remove: %v", err)
	}
	if list, _ := d.List(ctx); len(list) != 1 || list[0].ID != b.ID {
		t.Fatalf("list after remove: %v", list)
	}
}

func TestCreateValidates(t *testing.T) {
	ctx := context.Background()
	d, _, _ := openTest(t)
	if _, err := d.Create(ctx, CreateRequest{}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("zero base: %v", err)
	}
	if _, err := d.Create(ctx, CreateRequest{Base: root("x"), TTL: -time.Second}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("negative ttl: %v", err)
	}
	if list, _ := d.List(ctx); len(list) != 0 {
		t.Fatalf("refused creates left records: %v", list)
	}
	// The empty tree is a valid base.
	if _, err := d.Create(ctx, CreateRequest{Base: casstore.EmptyHash}); err != nil {
		t.Fatal(err)
	}
}

func TestAmbiguousLabel(t *testing.T) {
	ctx := context.Background()
	d, _, _ := openTest(t)
	for i := 0; i < 2; i++ {
		if _, err := d.Create(ctx, CreateRequest{Base: root("x"), Label: "same"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.Get(ctx, "same"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("ambiguous label: %v", err)
	}
}

func TestAdvanceCompareAndSwap(t *testing.T) {
	ctx := context.Background()
	d, c, _ := openTest(t)
	f, err := d.Create(ctx, CreateRequest{Base: root("v0")})
	if err != nil {
		t.Fatal(err)
	}
	c.Add(time.Minute)
	g, err := d.Advance(ctx, f.ID, root("v0"), root("v1"), "commit")
	if err != nil {
		t.Fatal(err)
	}
	if g.Root != root("v1") || g.Base != root("v0") || len(g.History) != 1 ||
		g.History[0] != (Revision{Root: root("v0"), Time: f.Created, Reason: "commit"}) || !g.Updated.Equal(c.Now()) {
		t.Fatalf("advanced %+v", g)
	}

	// A writer that read v0 lost the race: conflict, and nothing changes.
	_, err = d.Advance(ctx, f.ID, root("v0"), root("other"), "commit")
	if !errors.Is(err, ErrConflict) || !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("stale expect: %v", err)
	}
	if now, _ := d.Get(ctx, f.ID); now.Root != root("v1") || len(now.History) != 1 {
		t.Fatalf("conflicting advance changed the fork: %+v", now)
	}

	// A zero expect is unconditional; moving to the current root adds no history.
	if g, err = d.Advance(ctx, f.ID, casstore.Hash{}, root("v2"), "reset"); err != nil || g.Root != root("v2") {
		t.Fatalf("unconditional advance: %+v, %v", g, err)
	}
	if g, err = d.Advance(ctx, f.ID, root("v2"), root("v2"), "noop"); err != nil || len(g.History) != 2 {
		t.Fatalf("same-root advance: %+v, %v", g, err)
	}
	if _, err := d.Advance(ctx, "0123456789abcdef", casstore.Hash{}, root("x"), ""); !errdefs.IsNotFound(err) {
		t.Fatalf("unknown fork: %v", err)
	}
}

func TestHistoryLimitAndLiveRoots(t *testing.T) {
	ctx := context.Background()
	d, c, _ := openTest(t)
	f, err := d.Create(ctx, CreateRequest{Base: root("base")})
	if err != nil {
		t.Fatal(err)
	}
	prev := root("base")
	const n = HistoryLimit + 5
	for i := 1; i <= n; i++ {
		c.Add(time.Second)
		next := root(fmt.Sprint("v", i))
		if _, err := d.Advance(ctx, f.ID, prev, next, fmt.Sprint("commit ", i)); err != nil {
			t.Fatal(err)
		}
		prev = next
	}
	got, err := d.Get(ctx, f.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.History) != HistoryLimit {
		t.Fatalf("history holds %d revisions, want %d", len(got.History), HistoryLimit)
	}
	// Newest last: the revision just before the current root, back to v(n-16).
	for i, r := range got.History {
		want := root(fmt.Sprint("v", n-HistoryLimit+i))
		if r.Root != want || r.Reason != fmt.Sprint("commit ", n-HistoryLimit+i+1) {
			t.Fatalf("history[%d] = %+v, want root v%d", i, r, n-HistoryLimit+i)
		}
	}

	if err := d.Pin("release", root("pinned")); err != nil {
		t.Fatal(err)
	}
	live, err := d.LiveRoots()
	if err != nil {
		t.Fatal(err)
	}
	want := map[casstore.Hash]bool{root("base"): true, root(fmt.Sprint("v", n)): true, root("pinned"): true}
	for _, r := range got.History {
		want[r.Root] = true
	}
	if len(live) != len(want) {
		t.Fatalf("live roots %d, want %d", len(live), len(want))
	}
	for _, h := range live {
		if !want[h] {
			t.Fatalf("unexpected live root %s", h)
		}
	}
	// A revision that fell off the history is no longer live.
	for _, h := range live {
		if h == root("v1") {
			t.Fatal("v1 fell off the history but is still live")
		}
	}
}

func TestSweepTTL(t *testing.T) {
	ctx := context.Background()
	d, c, _ := openTest(t)
	start := c.Now()
	short, _ := d.Create(ctx, CreateRequest{Base: root("a"), TTL: time.Hour})
	long, _ := d.Create(ctx, CreateRequest{Base: root("b"), TTL: 2 * time.Hour})
	forever, _ := d.Create(ctx, CreateRequest{Base: root("c")})

	if gone, err := d.Sweep(start.Add(time.Hour - time.Nanosecond)); err != nil || len(gone) != 0 {
		t.Fatalf("sweep before expiry: %v, %v", gone, err)
	}
	gone, err := d.Sweep(start.Add(time.Hour))
	if err != nil || len(gone) != 1 || gone[0] != short.ID {
		t.Fatalf("sweep at expiry: %v, %v", gone, err)
	}
	gone, _ = d.Sweep(start.Add(1000 * time.Hour))
	if len(gone) != 1 || gone[0] != long.ID {
		t.Fatalf("late sweep: %v", gone)
	}
	if list, _ := d.List(ctx); len(list) != 1 || list[0].ID != forever.ID {
		t.Fatalf("left: %v", list)
	}
	if (&Fork{Created: start}).Expired(start.Add(1e6 * time.Hour)) {
		t.Fatal("a fork without TTL expired")
	}
}

func TestPins(t *testing.T) {
	d, _, _ := openTest(t)
	if err := d.Pin("", root("x")); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("empty pin name: %v", err)
	}
	if err := d.Pin("a", root("1")); err != nil {
		t.Fatal(err)
	}
	if err := d.Pin("b", root("2")); err != nil {
		t.Fatal(err)
	}
	if err := d.Pin("a", root("3")); err != nil { // re-pinning moves the pin
		t.Fatal(err)
	}
	pins, err := d.Pins()
	if err != nil || len(pins) != 2 || pins["a"] != root("3") || pins["b"] != root("2") {
		t.Fatalf("pins %v, %v", pins, err)
	}
	if err := d.Unpin("a"); err != nil {
		t.Fatal(err)
	}
	if err := d.Unpin("never pinned"); err != nil {
		t.Fatal(err)
	}
	live, _ := d.LiveRoots()
	if len(live) != 1 || live[0] != root("2") {
		t.Fatalf("live roots %v", live)
	}
}

func TestLockAndPersistence(t *testing.T) {
	ctx := context.Background()
	d, _, path := openTest(t)
	f, err := d.Create(ctx, CreateRequest{Base: root("a"), Label: "kept"})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := OpenDB(path, 100*time.Millisecond); !errors.Is(err, ErrLocked) {
		t.Fatalf("second open: %v, want ErrLocked", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("second open ignored its timeout")
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d2, err := OpenDB(path, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	got, err := d2.Get(ctx, "kept")
	if err != nil || got.ID != f.ID {
		t.Fatalf("after reopen: %+v, %v", got, err)
	}
}

func TestForkJSONContract(t *testing.T) {
	f := Fork{ID: "0123456789abcdef", Label: "l", Base: root("a"), Root: root("b"), Created: time.Unix(0, 0).UTC(), TTL: Duration(90 * time.Minute)}
	b, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{"id": f.ID, "label": "l", "base": root("a").String(), "root": root("b").String(),
		"created": "1970-01-01T00:00:00Z", "ttl": "1h30m0s"} {
		if m[k] != want {
			t.Errorf("%s = %v, want %v", k, m[k], want)
		}
	}
	var back Fork
	if err := json.Unmarshal(b, &back); err != nil || back.TTL != f.TTL || back.Root != f.Root {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
}

func TestResolve(t *testing.T) {
	ctx := context.Background()
	d, _, _ := openTest(t)
	f, _ := d.Create(ctx, CreateRequest{Base: root("a"), Label: "web"})
	h := root("zzz")
	for _, tc := range []struct {
		ref  string
		want casstore.Hash
		fork bool
		err  func(error) bool
	}{
		{ref: h.String(), want: h},
		{ref: f.ID, want: root("a"), fork: true},
		{ref: "web", want: root("a"), fork: true},
		{ref: "AF1349B9F5F9A1A6A0404DEA36DCC9499BCB25C9ADC112B7CC9A93CAE41F3262", err: errdefs.IsInvalidArgument},
		{ref: "", err: errdefs.IsInvalidArgument},
		{ref: "missing", err: errdefs.IsNotFound},
	} {
		got, err := Resolve(ctx, d, tc.ref)
		if tc.err != nil {
			if !tc.err(err) {
				t.Errorf("resolve %q: %v", tc.ref, err)
			}
			continue
		}
		if err != nil || got.Root != tc.want || (got.Fork != nil) != tc.fork {
			t.Errorf("resolve %q = %+v, %v", tc.ref, got, err)
		}
	}
	if _, err := Resolve(ctx, nil, "web"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("resolve without a service: %v", err)
	}
}

// TestConcurrentAdvance: writers race to advance one fork with compare-and-swap. The
// successful advances must form one chain from the base (no lost update), while other
// goroutines create, list and read forks.
func TestConcurrentAdvance(t *testing.T) {
	ctx := context.Background()
	d, _, _ := openTest(t)
	f, err := d.Create(ctx, CreateRequest{Base: root("base"), Label: "shared"})
	if err != nil {
		t.Fatal(err)
	}
	const writers, each = 4, 25
	type step struct{ from, to casstore.Hash }
	var mu sync.Mutex
	var steps []step
	var wg sync.WaitGroup
	errs := make(chan error, writers*2)
	for w := 0; w < writers; w++ {
		wg.Add(2)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < each; {
				cur, err := d.Get(ctx, "shared")
				if err != nil {
					errs <- err
					return
				}
				next := root(fmt.Sprint(w, "/", i))
				g, err := d.Advance(ctx, f.ID, cur.Root, next, "commit")
				if errors.Is(err, ErrConflict) {
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				if last := g.History[len(g.History)-1].Root; last != cur.Root {
					errs <- fmt.Errorf("advance from %s recorded %s as the previous root", cur.Root.Short(), last.Short())
					return
				}
				mu.Lock()
				steps = append(steps, step{cur.Root, next})
				mu.Unlock()
				i++
			}
		}(w)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < each; i++ {
				if _, err := d.Create(ctx, CreateRequest{Base: root(fmt.Sprint("other", w, i))}); err != nil {
					errs <- err
					return
				}
				if _, err := d.List(ctx); err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	next := map[casstore.Hash]casstore.Hash{}
	for _, s := range steps {
		if _, dup := next[s.from]; dup {
			t.Fatalf("two advances both started from %s: a lost update", s.from.Short())
		}
		next[s.from] = s.to
	}
	cur, n := root("base"), 0
	for {
		to, ok := next[cur]
		if !ok {
			break
		}
		cur, n = to, n+1
	}
	final, _ := d.Get(ctx, f.ID)
	if n != writers*each || final.Root != cur {
		t.Fatalf("chain of %d advances ends at %s; want %d ending at the fork's root %s", n, cur.Short(), writers*each, final.Root.Short())
	}
	list, _ := d.List(ctx)
	if len(list) != 1+writers*each {
		t.Fatalf("%d forks, want %d", len(list), 1+writers*each)
	}
	ids := map[string]bool{}
	for _, f := range list {
		ids[f.ID] = true
	}
	if len(ids) != len(list) {
		t.Fatal("duplicate fork ids")
	}
}

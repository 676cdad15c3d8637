package snapshotter

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tidepool-dev/tidepool/casstore"
)

// prebuildRecorder is a ViewHost that records Prebuild calls.
type prebuildRecorder struct {
	ViewHost
	mu    sync.Mutex
	specs []ViewSpec
	block chan struct{} // if set, Prebuild waits on it (or its context)
	warm  []int         // for each WarmUp, how many Prebuilds had run before it
}

func (r *prebuildRecorder) WarmUp(context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.warm = append(r.warm, len(r.specs))
	return nil
}

func (r *prebuildRecorder) Prebuild(ctx context.Context, spec ViewSpec) error {
	if r.block != nil {
		select {
		case <-r.block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.specs = append(r.specs, spec)
	return nil
}

func (r *prebuildRecorder) wait(t *testing.T, n int) []ViewSpec {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r.mu.Lock()
		got := append([]ViewSpec(nil), r.specs...)
		r.mu.Unlock()
		if len(got) >= n || time.Now().After(deadline) {
			if len(got) != n {
				t.Fatalf("%d prebuilds, want %d: %+v", len(got), n, got)
			}
			return got
		}
		time.Sleep(time.Millisecond)
	}
}

func shapeSpec(prefix string, id uint32) ViewSpec { return ViewSpec{Prefix: prefix, UID: id, GID: id} }

// TestArrivalsShapes: the worker warms the view host up once, before it prepares
// anything; a root that arrives is prepared for the distinct shapes of the last
// recentViewShapes views, most recent first; a commit for exactly its own.
func TestArrivalsShapes(t *testing.T) {
	rec := &prebuildRecorder{}
	a := newArrivals(context.Background(), rec, newMetrics(), "")
	defer a.close()
	for _, s := range []ViewSpec{shapeSpec("a", 1), shapeSpec("b", 1), shapeSpec("a", 1), shapeSpec("a", 2), shapeSpec("c", 1), shapeSpec("d", 1)} {
		a.seen(s)
	}
	root := casstore.Sum([]byte("root"))
	a.arrived(root, arrivedViaAPI)
	got := rec.wait(t, recentViewShapes)
	rec.mu.Lock()
	if len(rec.warm) != 1 || rec.warm[0] != 0 {
		t.Errorf("warm-ups (prebuilds before each): %v, want one before any prebuild", rec.warm)
	}
	rec.mu.Unlock()
	want := []ViewSpec{shapeSpec("d", 1), shapeSpec("c", 1), shapeSpec("a", 2), shapeSpec("a", 1)} // b: the oldest
	for i := range want {
		want[i].Root = root
		if got[i] != want[i] {
			t.Errorf("prebuild %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	next := casstore.Sum([]byte("next"))
	a.committed(ViewSpec{Root: next, Prefix: "e", UID: 7, GID: 8})
	if got := rec.wait(t, recentViewShapes+1)[recentViewShapes]; got != (ViewSpec{Root: next, Prefix: "e", UID: 7, GID: 8}) {
		t.Errorf("commit's prebuild: %+v", got)
	}
	a.arrived(casstore.Hash{}, arrivedViaAPI) // no root: nothing
	if a.recent[0] != (viewShape{"e", 7, 8}) || len(a.recent) != recentViewShapes {
		t.Errorf("recent shapes after a commit: %+v", a.recent)
	}
	// Roots recorded while no tidepoold ran are prepared as those told are.
	spooled := casstore.Sum([]byte("spooled"))
	a.arrived(spooled, arrivedViaSpool)
	if got := rec.wait(t, 2*recentViewShapes+1)[recentViewShapes+1]; got != (ViewSpec{Root: spooled, Prefix: "e", UID: 7, GID: 8}) {
		t.Errorf("a recorded root's first prebuild: %+v", got)
	}
	m := a.m
	for via, want := range map[string]float64{arrivedViaAPI: 1, arrivedViaCommit: 1, arrivedViaSpool: 1} {
		if got := testutil.ToFloat64(m.rootsArrived.WithLabelValues(via)); got != want {
			t.Errorf("roots arrived via %s: %v, want %v", via, got, want)
		}
	}
	waitGauge(t, m.viewsPending, 0)
	if got := testutil.ToFloat64(m.viewsPrepared); got != 2*recentViewShapes+1 {
		t.Errorf("views prepared: %v, want %v", got, 2*recentViewShapes+1)
	}
}

// waitGauge waits for g to read want (the worker counts a prebuild done just after
// it returns).
func waitGauge(t *testing.T, g prometheus.Gauge, want float64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for testutil.ToFloat64(g) != want {
		if time.Now().After(deadline) {
			t.Fatalf("gauge %v, want %v", testutil.ToFloat64(g), want)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestArrivalsBounded: a full queue drops what does not fit rather than block the
// request that told of the root, and close cancels a build under way.
func TestArrivalsBounded(t *testing.T) {
	rec := &prebuildRecorder{block: make(chan struct{})}
	a := newArrivals(context.Background(), rec, newMetrics(), "")
	for i := 0; i < arrivalQueue*2; i++ {
		spec := shapeSpec("w", 1)
		spec.Root = casstore.Sum([]byte{byte(i), byte(i >> 8)})
		a.committed(spec)
	}
	done := make(chan struct{})
	go func() { a.close(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("close did not cancel a blocked build")
	}
	if n := len(rec.specs); n != 0 {
		t.Fatalf("%d builds finished, want none", n)
	}
	// The dropped ones were never pending; the queued ones stay counted as pending
	// only while the worker runs (a closed one takes nothing more).
	if got := testutil.ToFloat64(a.m.viewsPending); got > arrivalQueue+1 {
		t.Fatalf("%v views pending, more than the queue holds", got)
	}
}

// TestArrivalsShapesSaved: the recent shapes outlive the process, so a root that
// arrives right after a restart is prepared; an unreadable file, or a saved workdir a
// label could not give, costs only those shapes.
func TestArrivalsShapesSaved(t *testing.T) {
	saved := filepath.Join(t.TempDir(), "view-shapes.json")
	a := newArrivals(context.Background(), &prebuildRecorder{}, newMetrics(), saved)
	a.seen(shapeSpec("app", 1000))
	a.seen(shapeSpec("src/repo", 0))
	a.close()
	if st, err := os.Stat(saved); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("saved shapes: %v, %v", st, err)
	}
	rec := &prebuildRecorder{}
	b := newArrivals(context.Background(), rec, newMetrics(), saved)
	root := casstore.Sum([]byte("after restart"))
	b.arrived(root, arrivedViaAPI)
	got := rec.wait(t, 2)
	b.close()
	for i, want := range []ViewSpec{shapeSpec("src/repo", 0), shapeSpec("app", 1000)} {
		want.Root = root
		if got[i] != want {
			t.Errorf("prebuild %d after a restart: %+v, want %+v", i, got[i], want)
		}
	}

	for _, content := range []string{"{not json", `[{"prefix":"../../etc","uid":0,"gid":0},{"prefix":"a//b","uid":0,"gid":0},{"prefix":"","uid":0,"gid":0},{"prefix":"ok","uid":5,"gid":5}]`} {
		if err := os.WriteFile(saved, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		rec := &prebuildRecorder{}
		c := newArrivals(context.Background(), rec, newMetrics(), saved)
		c.arrived(root, arrivedViaAPI)
		want := 0
		if content[0] == '[' {
			want = 1 // only "ok"
		}
		got := rec.wait(t, want)
		c.close()
		if want == 1 && got[0] != (ViewSpec{Root: root, Prefix: "ok", UID: 5, GID: 5}) {
			t.Errorf("from %s: prebuilt %+v", content, got[0])
		}
	}
}

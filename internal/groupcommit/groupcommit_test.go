package groupcommit

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
)

// fakeDB is a database whose transactions apply writes to a map, one transaction at
// a time, each held open until the test lets it commit.
type fakeDB struct {
	mu      sync.Mutex // one writer at a time, as bbolt
	data    map[string]int
	commits int
	gate    chan struct{} // receives once per commit, if set
}

func (d *fakeDB) commit(apply func(map[string]int) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	tx := map[string]int{}
	for k, v := range d.data {
		tx[k] = v
	}
	if d.gate != nil {
		<-d.gate
	}
	if err := apply(tx); err != nil {
		return err // rolled back
	}
	d.data = tx
	d.commits++
	return nil
}

func TestLoneWriteCommitsAlone(t *testing.T) {
	db := &fakeDB{data: map[string]int{}}
	g := &Group[map[string]int]{Commit: db.commit}
	for i := 0; i < 3; i++ {
		if err := g.Do(func(tx map[string]int) error { tx[fmt.Sprint(i)] = i; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	if db.commits != 3 || len(db.data) != 3 {
		t.Fatalf("%d commits, data %v", db.commits, db.data)
	}
}

// TestConcurrentWritesShareTransactions: while one transaction runs, every write that
// arrives waits and then commits in one shared transaction; all land, each once.
func TestConcurrentWritesShareTransactions(t *testing.T) {
	const n = 50
	db := &fakeDB{data: map[string]int{}, gate: make(chan struct{}, n+1)}
	g := &Group[map[string]int]{Commit: db.commit}
	first := make(chan error, 1)
	go func() { first <- g.Do(func(tx map[string]int) error { tx["first"] = 1; return nil }) }()
	// Wait until the first write leads a running transaction.
	waitQueued(g, 0)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs[i] = g.Do(func(tx map[string]int) error { tx[fmt.Sprint(i)]++; return nil })
		}(i)
	}
	// Let everyone queue behind the first transaction, then let every transaction
	// (however many there are) commit.
	waitQueued(g, n)
	for i := 0; i < n+1; i++ {
		db.gate <- struct{}{}
	}
	wg.Wait()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	db.mu.Lock()
	defer db.mu.Unlock()
	if db.commits != 2 {
		t.Fatalf("%d transactions for %d concurrent writes behind one, want 2", db.commits, n)
	}
	for i := 0; i < n; i++ {
		if db.data[fmt.Sprint(i)] != 1 {
			t.Fatalf("write %d applied %d times", i, db.data[fmt.Sprint(i)])
		}
	}
}

// TestFailedWriteFailsAlone: a write that fails makes the shared transaction fail;
// the others are retried alone and land, and only the failing write sees its error.
func TestFailedWriteFailsAlone(t *testing.T) {
	db := &fakeDB{data: map[string]int{}}
	g := &Group[map[string]int]{Commit: db.commit}
	boom := errors.New("snapshot gone")
	hold := make(chan struct{})
	go g.Do(func(tx map[string]int) error { <-hold; return nil })
	for {
		g.mu.Lock()
		running := g.running
		g.mu.Unlock()
		if running {
			break
		}
	}
	var wg sync.WaitGroup
	results := make([]error, 10)
	for i := range results {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			results[i] = g.Do(func(tx map[string]int) error {
				if i == 3 {
					return boom
				}
				tx[fmt.Sprint(i)] = i
				return nil
			})
		}(i)
	}
	waitQueued(g, len(results))
	close(hold)
	wg.Wait()
	for i, err := range results {
		if i == 3 {
			if !errors.Is(err, boom) {
				t.Fatalf("failing write got %v", err)
			}
			continue
		}
		if err != nil || db.data[fmt.Sprint(i)] != i {
			t.Fatalf("write %d: %v, data %v", i, err, db.data)
		}
	}
}

// waitQueued waits until a transaction runs and n writes wait behind it.
func waitQueued[T any](g *Group[T], n int) {
	for {
		g.mu.Lock()
		ok := g.running && len(g.queue) == n
		g.mu.Unlock()
		if ok {
			return
		}
		runtime.Gosched()
	}
}

package faults

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestGCRacesWriters runs `gc --grace 0` in a loop beside writers that ingest, fork
// and commit through tidepoold. Guarantee: a fork record never names a collected
// object and a commit to a fork never fails because of gc; a fork of a root that gc
// swept before the fork was recorded fails cleanly ("not in the store"), which is
// what --grace 0 means for a root nothing references yet. fsck is clean at the end.
func TestGCRacesWriters(t *testing.T) {
	e := newEnv(t)
	r := seed(t)
	e.startDaemon()
	const writers, rounds = 2, 12

	ctx, stop := context.WithCancel(context.Background())
	var gcRuns atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			if _, err := e.run("gc", "--grace", "0"); err != nil {
				t.Errorf("gc: %v", err)
				return
			}
			gcRuns.Add(1)
		}
	}()

	var mu sync.Mutex
	var failures []string
	var forksRefused, commits atomic.Int64
	fail := func(format string, a ...any) {
		mu.Lock()
		failures = append(failures, fmt.Sprintf(format, a...))
		mu.Unlock()
	}
	var ww sync.WaitGroup
	for w := 0; w < writers; w++ {
		wr := rand.New(rand.NewSource(r.Int63()))
		ww.Add(1)
		go func(w int) {
			defer ww.Done()
			for i := 0; i < rounds; i++ {
				dir := filepath.Join(t.TempDir(), "src")
				writeTree(t, wr, dir, 20+wr.Intn(30), 8192)
				// With --grace 0 a root nothing records yet may be swept before its
				// fork: the fork is refused cleanly, and a user ingests again.
				var out string
				var err error
				for attempt := 0; attempt < 5; attempt++ {
					if out, err = e.run("ingest", dir); err != nil {
						fail("writer %d round %d: ingest: %v", w, i, err)
						break
					}
					root := lastLine(out)
					time.Sleep(time.Duration(wr.Intn(20)) * time.Millisecond)
					if out, err = e.run("fork", root); err == nil || !strings.Contains(err.Error(), "not in the store") {
						break
					}
					forksRefused.Add(1)
				}
				if err != nil {
					if !strings.Contains(err.Error(), "not in the store") {
						fail("writer %d round %d: fork: %v", w, i, err)
					}
					continue
				}
				id := strings.TrimSpace(out)
				upper := filepath.Join(t.TempDir(), "upper")
				writeTree(t, wr, upper, 1+wr.Intn(5), 4096)
				if _, err := e.run("commit", "--base", id, "--upper", upper); err != nil {
					fail("writer %d round %d: commit: %v", w, i, err)
					continue
				}
				commits.Add(1)
			}
		}(w)
	}
	ww.Wait()
	stop()
	wg.Wait()
	out, err := e.run("fsck")
	if err != nil {
		fail("fsck: %v\n%s", err, out)
	}
	t.Logf("%d writers x %d rounds beside %d gc runs: %d commits, %d forks refused (root swept before it was recorded), %d failures",
		writers, rounds, gcRuns.Load(), commits.Load(), forksRefused.Load(), len(failures))
	for _, f := range failures {
		t.Error(f)
	}
	if commits.Load() == 0 {
		t.Error("no commit went through: the race was not exercised")
	}
	_ = os.Remove
}

package pool

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestYieldToClaims: background work goes at once when no claim took a member lately,
// waits for claims to be quiet after one did, and goes at once when it turns urgent.
func TestYieldToClaims(t *testing.T) {
	var a claimActivity
	ctx := context.Background()
	if w := a.yield(ctx, nil); w > claimQuiet/2 {
		t.Fatalf("no claims yet, yet background work waited %v", w)
	}
	a.took()
	if w := a.yield(ctx, nil); w < claimQuiet*3/4 {
		t.Fatalf("background work went %v after a claim, before claims were quiet for %v", w, claimQuiet)
	}
	a.took()
	var urgent atomic.Bool
	time.AfterFunc(10*time.Millisecond, func() { urgent.Store(true) })
	start := time.Now()
	a.yield(ctx, urgent.Load)
	if !urgent.Load() {
		t.Fatalf("yield returned after %v, before the work turned urgent", time.Since(start))
	}
}

// TestRefillWaitsForClaims: a claim that takes a member makes the refill it triggers
// wait until claims are quiet; a claim that finds the pool empty makes it start at
// once.
func TestRefillWaitsForClaims(t *testing.T) {
	for _, tc := range []struct {
		name  string
		idle  int
		early bool // the refill may start before claims are quiet
	}{
		{"yields", 2, false}, // members left: the refill waits for claims to be quiet
		{"urgent", 0, true},  // the pool is empty and a claim waits: refill at once
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, sn, _ := testController(t, Template{Target: 3, RefillRate: 1000})
			p := c.pools["node"][0]
			member, _ := baseSpec()
			for i := 0; i < tc.idle; i++ {
				addMember(t, c, sn, member, "img", time.Now())
			}
			var (
				mu      sync.Mutex
				started []time.Time
			)
			c.newMember = func(p *Pool, ctx context.Context) (*Member, error) {
				mu.Lock()
				started = append(started, time.Now())
				mu.Unlock()
				return newFakeMember(t, p, sn, member, "img", time.Now()), nil
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			claimed := time.Now()
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := p.take(ctx); err != nil {
					t.Error(err)
				}
			}()
			if tc.idle > 0 {
				wg.Wait() // taken: now the refill it asks for
			} else {
				for !p.urgent() { // the claim waits: now the refill
					time.Sleep(time.Millisecond)
				}
			}
			maintained := make(chan struct{})
			go func() {
				defer close(maintained)
				p.maintain(ctx)
			}()
			// The refill loop goes before the test's directories do.
			defer func() {
				cancel()
				<-maintained
			}()
			wg.Wait()
			deadline := time.Now().Add(5 * time.Second)
			for {
				mu.Lock()
				n := len(started)
				var first time.Time
				if n > 0 {
					first = started[0]
				}
				mu.Unlock()
				if n > 0 {
					waited := first.Sub(claimed)
					if !tc.early && waited < claimQuiet*3/4 {
						t.Fatalf("refill started %v after the claim, while claims were not quiet", waited)
					}
					if tc.early && waited >= claimQuiet*3/4 {
						t.Fatalf("refill for a waiting claim started only after %v", waited)
					}
					return
				}
				if time.Now().After(deadline) {
					t.Fatal("no refill started")
				}
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
}

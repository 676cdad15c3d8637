package pool

import (
	"context"
	"sync/atomic"
	"time"
)

// Claims come first. Starting a member (container, snapshot and view, shim, runc
// create) or tearing a used one down costs as much CPU and as many metadata writes as
// a claim does, and on a small host a burst of claims would share both with the
// refill it triggers and with the teardown of the claims that finished first: the
// later claims of the burst would wait behind background work the earlier ones caused.
// So background work yields: it starts only once no claim has taken a member for
// claimQuiet, unless it is urgent (a claim is waiting for a member, or the pool is
// below its min), and it never waits longer than backgroundMaxDefer, so a steady
// stream of claims cannot starve the refill that feeds it.
const (
	claimQuiet         = 200 * time.Millisecond
	backgroundMaxDefer = 2 * time.Second
)

// claimActivity is when a claim last took a member, controller-wide: every pool's
// background work competes with every pool's claims for the same host.
type claimActivity struct {
	last atomic.Int64 // unix nanoseconds; 0: never
}

func (a *claimActivity) took() { a.last.Store(time.Now().UnixNano()) }

// quietIn is how long until claims will have been quiet for claimQuiet (<= 0: now).
func (a *claimActivity) quietIn(now time.Time) time.Duration {
	last := a.last.Load()
	if last == 0 {
		return 0
	}
	return time.Unix(0, last).Add(claimQuiet).Sub(now)
}

// yield waits until claims are quiet, urgent reports true, ctx ends, or
// backgroundMaxDefer has passed. It reports how long it waited.
func (a *claimActivity) yield(ctx context.Context, urgent func() bool) time.Duration {
	start := time.Now()
	deadline := start.Add(backgroundMaxDefer)
	for {
		if urgent != nil && urgent() {
			return time.Since(start)
		}
		now := time.Now()
		d := a.quietIn(now)
		if d <= 0 || !now.Before(deadline) {
			return now.Sub(start)
		}
		// Check urgency at least every claimQuiet/4: a claim may start waiting.
		d = min(d, deadline.Sub(now), claimQuiet/4)
		select {
		case <-ctx.Done():
			return time.Since(start)
		case <-time.After(d):
		}
	}
}

// Package containerdreach decides when a starting tidepoold may say it is ready: once
// containerd's connection to its snapshotter socket works again.
//
// containerd reaches a proxy snapshotter over one gRPC connection. When tidepoold is
// down (a crash leaves its socket file behind; a stop removes it) and containerd
// calls it meanwhile, that connection fails and then waits out a reconnect backoff
// (1 s, growing to 3 s in containerd 2.x), and every call made during the backoff
// fails at once with "connection error". So a tidepoold that comes back during a
// backoff is up but unusable for up to 3 s: `systemctl restart tidepoold` would
// return, and the next `ctr run` or kubelet call would fail.
//
// tidepoold therefore asks containerd about one of its own snapshots (containerd
// answers a Stat from its records only after asking the snapshotter) until the answer
// comes through, before it tells systemd READY=1. A call that fails with Unavailable
// is the backoff; anything else (an answer, or another error) means containerd's
// connection is up, or that waiting would not help. The wait is bounded, and skipped
// when there is nothing to ask about (no snapshot containerd knows of) or containerd
// itself is not up (tidepoold starts before containerd at boot).
package containerdreach

import (
	"context"
	"strings"
	"time"

	"github.com/containerd/errdefs"
)

// Key is a snapshot as containerd names it: its namespace and its key there.
type Key struct{ Namespace, Name string }

// KeyOf returns the containerd key of a snapshot as the snapshotter knows it:
// containerd's metadata store names the snapshots it creates "NAMESPACE/ID/KEY".
func KeyOf(backend string) (Key, bool) {
	ns, rest, ok := strings.Cut(backend, "/")
	if !ok || ns == "" {
		return Key{}, false
	}
	id, name, ok := strings.Cut(rest, "/")
	if !ok || id == "" || name == "" || strings.Trim(id, "0123456789") != "" {
		return Key{}, false
	}
	return Key{Namespace: ns, Name: name}, true
}

// Prober asks containerd to Stat a snapshot of this snapshotter.
type Prober interface {
	Stat(ctx context.Context, k Key) error
}

// Outcome says how a Wait ended.
type Outcome string

const (
	// Reached: containerd answered a Stat that it had to ask tidepoold about.
	Reached Outcome = "reached"
	// NothingToAsk: no key containerd knows of (every Stat was NotFound), or none given.
	NothingToAsk Outcome = "nothing to ask"
	// Unknown: an error other than Unavailable; waiting would not tell more.
	Unknown Outcome = "unknown"
	// TimedOut: containerd still could not reach tidepoold after the longest wait.
	TimedOut Outcome = "timed out"
)

// Options bound a Wait.
type Options struct {
	// Max is the longest wait (containerd's backoff is at most 3 s, plus jitter).
	Max time.Duration
	// Interval is the pause between tries while containerd is in backoff.
	Interval time.Duration
	// PerCall bounds one Stat.
	PerCall time.Duration
}

// DefaultOptions wait up to 10 s, trying every 50 ms.
var DefaultOptions = Options{Max: 10 * time.Second, Interval: 50 * time.Millisecond, PerCall: 2 * time.Second}

// Wait asks p about keys (in order: the first that containerd knows of) until
// containerd reaches the snapshotter, and returns how that ended and the last error.
func Wait(ctx context.Context, p Prober, keys []Key, o Options) (Outcome, error) {
	deadline := time.Now().Add(o.Max)
	var last error
	for len(keys) > 0 {
		if err := ctx.Err(); err != nil {
			return Unknown, err
		}
		cctx, cancel := context.WithTimeout(ctx, o.PerCall)
		err := p.Stat(cctx, keys[0])
		cancel()
		switch {
		case err == nil:
			return Reached, nil
		case errdefs.IsNotFound(err):
			// Not in containerd's records (containerd answers that without asking the
			// snapshotter): ask about the next one.
			keys, last = keys[1:], err
			continue
		case !errdefs.IsUnavailable(err):
			return Unknown, err
		}
		last = err // containerd's connection is in backoff: try again
		if time.Now().Add(o.Interval).After(deadline) {
			return TimedOut, last
		}
		select {
		case <-ctx.Done():
			return Unknown, ctx.Err()
		case <-time.After(o.Interval):
		}
	}
	return NothingToAsk, last
}

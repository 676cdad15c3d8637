// Package fsck checks a store's integrity: every object is re-hashed against its name,
// and every object reachable from a live root must exist and, if it is a tree, decode.
// Reads normally verify each object once per process; fsck is how bit rot or a
// tampered object is found before anything asks for it.
//
// With Quarantine, objects whose bytes do not match their name are moved aside into
// <store>/.quarantine/ (after a second check under the store's exclusive lock, so a
// copy repaired in the meantime is never moved). A quarantined object then counts as
// missing, which a later ingest or fetch of the same content repairs.
package fsck

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sync/errgroup"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/gc"
)

// Options tune a check.
type Options struct {
	// Quarantine moves corrupt objects into <store>/.quarantine/.
	Quarantine bool
	// Roots are extra live roots to check reachability from (e.g. active snapshots).
	Roots []casstore.Hash
	// Workers is how many objects are hashed at once; zero means GOMAXPROCS.
	Workers int
}

// BadObject is an object whose file does not hold what its name says.
type BadObject struct {
	Hash casstore.Hash
	Path string        // the object's file in the store
	Got  casstore.Hash // what the bytes hash to; zero when they could not be read
	Err  error
	// Quarantined is where the object was moved, when Options.Quarantine was set.
	Quarantined string
}

// String renders the object for a one-line report.
func (b BadObject) String() string {
	s := fmt.Sprintf("%s: %v", b.Hash, b.Err)
	if b.Quarantined != "" {
		s += " (moved to " + b.Quarantined + ")"
	}
	return s
}

// Report is the outcome of a check.
type Report struct {
	Objects int   // objects re-hashed
	Bytes   int64 // bytes re-hashed
	Bad     []BadObject
	// Reachability from the live roots, checked after any quarantine.
	Roots       int
	Missing     []gc.Problem // reachable objects not in the store
	Undecodable []gc.Problem // reachable trees Tidepool's codec refuses
	Unreadable  []gc.Problem // reachable trees that are corrupt or cannot be parsed at all
	// Leftovers are staged temp files whose writer no longer runs (a process killed
	// mid-ingest). They are not objects and harm nothing but space; the next writer
	// or tidepoold's start removes them.
	Leftovers []casstore.TempFile
	// SizesForgotten counts the size index entries fsck dropped: objects that are
	// gone (deleted by hand) or whose file's size is not the one recorded (corrupt).
	// Dropping them is always safe: an absent entry means a stat.
	SizesForgotten int
}

// Healthy reports whether the check found nothing wrong.
func (r *Report) Healthy() bool {
	return len(r.Bad) == 0 && len(r.Missing) == 0 && len(r.Undecodable) == 0 && len(r.Unreadable) == 0
}

// Check re-hashes every object of s and checks what src's live roots (and
// opts.Roots) reach. src may be nil. The returned error is about the check itself
// (I/O on the store, cancellation); problems with objects are in the report.
func Check(ctx context.Context, s *casstore.Store, src gc.RootSource, opts Options) (*Report, error) {
	r := &Report{}
	temps, err := s.TempFiles()
	if err != nil {
		return r, fmt.Errorf("fsck: %w", err)
	}
	for _, t := range temps {
		if !t.Alive {
			r.Leftovers = append(r.Leftovers, t)
		}
	}
	if err := r.verifyAll(ctx, s, opts.Workers); err != nil {
		return r, err
	}
	if opts.Quarantine && len(r.Bad) > 0 {
		if testHookBeforeQuarantine != nil {
			testHookBeforeQuarantine()
		}
		if err := r.quarantine(s); err != nil {
			return r, err
		}
	}
	roots := append([]casstore.Hash(nil), opts.Roots...)
	if src != nil {
		live, err := src.LiveRoots()
		if err != nil {
			return r, fmt.Errorf("fsck: list live roots: %w", err)
		}
		roots = append(roots, live...)
	}
	m, err := gc.Mark(ctx, s, roots)
	if err != nil {
		return r, fmt.Errorf("fsck: %w", err)
	}
	uniq := map[casstore.Hash]struct{}{}
	for _, h := range roots {
		uniq[h] = struct{}{}
	}
	r.Roots = len(uniq)
	r.Missing, r.Undecodable, r.Unreadable = m.Missing, m.Undecodable, m.Unreadable
	return r, nil
}

// testHookBeforeQuarantine lets tests repair an object between the check and the
// quarantine, as a concurrent writer could.
var testHookBeforeQuarantine func()

type object struct {
	h    casstore.Hash
	path string
}

func (r *Report) verifyAll(ctx context.Context, s *casstore.Store, workers int) error {
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	g, ctx := errgroup.WithContext(ctx)
	work := make(chan object, 4*workers)
	g.Go(func() error {
		defer close(work)
		return s.Walk(func(h casstore.Hash, path string) error {
			select {
			case work <- object{h, path}:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	})
	var mu sync.Mutex
	good := map[casstore.Hash]int64{}
	for i := 0; i < workers; i++ {
		g.Go(func() error {
			for o := range work {
				size, err := s.Size(o.h)
				if errdefs.IsNotFound(err) {
					continue // removed since it was listed (a concurrent gc)
				}
				var bad *BadObject
				if err == nil {
					err = s.Verify(o.h)
				}
				if err != nil && !errdefs.IsNotFound(err) {
					bad = &BadObject{Hash: o.h, Path: o.path, Err: err}
					var ce *casstore.CorruptError
					if errors.As(err, &ce) {
						bad.Got = ce.Got
					}
				}
				mu.Lock()
				r.Objects++
				r.Bytes += size
				if bad != nil {
					r.Bad = append(r.Bad, *bad)
				} else {
					good[o.h] = size
				}
				mu.Unlock()
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return fmt.Errorf("fsck: %w", err)
	}
	sort.Slice(r.Bad, func(i, j int) bool { return r.Bad[i].Path < r.Bad[j].Path })
	return r.reconcileSizes(s, good)
}

// reconcileSizes drops the size index entries that disagree with the objects just
// verified (good: each sound object's size). An object published after the walk
// listed the store loses its entry too, which costs only a stat later.
func (r *Report) reconcileSizes(s *casstore.Store, good map[casstore.Hash]int64) error {
	if err := s.RefreshSizes(); err != nil {
		return fmt.Errorf("fsck: %w", err)
	}
	var stale []casstore.Hash
	s.KnownSizes(func(h casstore.Hash, size int64) {
		if got, ok := good[h]; !ok || got != size {
			stale = append(stale, h)
		}
	})
	if len(stale) == 0 {
		return nil
	}
	unlock, err := s.LockExclusive()
	if err != nil {
		return fmt.Errorf("fsck: %w", err)
	}
	defer unlock()
	if err := s.ForgetSizes(stale); err != nil {
		return fmt.Errorf("fsck: %w", err)
	}
	r.SizesForgotten = len(stale)
	return nil
}

// quarantine moves the corrupt objects aside under the store's exclusive lock, after
// verifying each one again: one that now checks out (rewritten by someone) stays, and
// is dropped from the report.
func (r *Report) quarantine(s *casstore.Store) error {
	unlock, err := s.LockExclusive()
	if err != nil {
		return fmt.Errorf("fsck: %w", err)
	}
	defer unlock()
	dir := filepath.Join(s.Root(), casstore.QuarantineDirName)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("fsck: %w", err)
	}
	stamp := strconv.FormatInt(time.Now().UnixNano(), 10)
	kept := r.Bad[:0]
	for _, b := range r.Bad {
		var ce *casstore.CorruptError
		if !errors.As(b.Err, &ce) {
			kept = append(kept, b) // unreadable, not proven corrupt: leave it in place
			continue
		}
		err := s.Verify(b.Hash)
		switch {
		case err == nil, errdefs.IsNotFound(err):
			continue // repaired or removed meanwhile
		case !errors.As(err, &ce):
			b.Err = err
			kept = append(kept, b)
			continue
		}
		b.Got, b.Err = ce.Got, err
		dst := filepath.Join(dir, b.Hash.String()+"."+stamp)
		if err := s.ForgetSizes([]casstore.Hash{b.Hash}); err != nil {
			return fmt.Errorf("fsck: quarantine %s: %w", b.Hash, err)
		}
		if err := os.Rename(b.Path, dst); err != nil {
			return fmt.Errorf("fsck: quarantine %s: %w", b.Hash, err)
		}
		b.Quarantined = dst
		kept = append(kept, b)
	}
	r.Bad = kept
	return nil
}

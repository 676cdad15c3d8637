// Package gc removes objects that no live root can reach. Forks, their recent history
// and pins (plus whatever roots the caller adds, such as active snapshots) are marked;
// every other object is swept, unless it is younger than a grace period.
//
// GC runs next to writers. A casstore batch holds the store's GC lock shared and
// refreshes the mtime of every existing object it reuses; new objects are new. So the
// sweep takes the lock exclusively (no batch is half-way through), marks roots that
// appeared since the mark phase, and deletes only unmarked objects older than the
// grace period, re-checking each one's mtime under the lock.
package gc

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore"
)

// DefaultGrace is how recently an object must have been written or reused to survive
// a collection whatever its reachability.
const DefaultGrace = time.Hour

// RootSource lists the roots that must survive; forks.DB implements it with every
// fork's base, root and history and every pin.
type RootSource interface {
	LiveRoots() ([]casstore.Hash, error)
}

// Options tune a collection.
type Options struct {
	// Grace keeps unreachable objects modified less than Grace before the collection
	// started. Zero means DefaultGrace; a negative value means no grace at all, which
	// is only safe when nothing else writes to the store.
	Grace time.Duration
	// DryRun reports what would be swept and deletes nothing.
	DryRun bool
	// Roots are extra live roots, e.g. the roots of active snapshots.
	Roots []casstore.Hash
}

// Result says what a collection did (or, for a dry run, would do).
type Result struct {
	Roots      int   // live roots marked from
	Marked     int   // distinct reachable hashes
	Swept      int   // objects removed (or that would be)
	BytesFreed int64 // their total size
	Young      int   // unreachable objects kept because of the grace period
	TempSwept  int   // stale temp files removed
	DryRun     bool
	// Missing lists reachable objects that are not in the store. The sweep still runs:
	// it only removes objects no root reaches.
	Missing []Problem
	// Undecodable lists reachable trees the strict codec refuses; their children were
	// kept alive through a lenient parse.
	Undecodable []Problem
}

// ErrUnreadableTrees says the sweep did not run because some reachable trees cannot
// be read, so what they reach is unknown. `tidepool fsck --quarantine` moves corrupt
// objects aside, after which they count as missing.
var ErrUnreadableTrees = fmt.Errorf("unreadable reachable trees: %w", errdefs.ErrDataLoss)

// Collect marks from src's live roots and opts.Roots, then sweeps. src may be nil.
func Collect(ctx context.Context, s *casstore.Store, src RootSource, opts Options) (Result, error) {
	// The grace period counts back from a moment no batch straddles. A batch stamps
	// its objects with one publication time and then renames them into place one by
	// one; had that time been before gc began, the listing below could see some of
	// them (old enough, unreachable) and not the rest (still being renamed), and a
	// tree could survive its children. Taking the lock once waits for such batches.
	barrier, err := s.LockExclusive()
	if err != nil {
		return Result{DryRun: opts.DryRun}, fmt.Errorf("gc: %w", err)
	}
	start := time.Now()
	barrier()
	grace := opts.Grace
	switch {
	case grace == 0:
		grace = DefaultGrace
	case grace < 0:
		grace = 0
	}
	cutoff := start.Add(-grace)
	res := Result{DryRun: opts.DryRun}

	roots, err := liveRoots(src, opts.Roots)
	if err != nil {
		return res, err
	}
	marks, err := Mark(ctx, s, roots)
	if err != nil {
		return res, err
	}
	if err := unreadable(marks); err != nil {
		return res, err
	}

	// Candidates are found without the lock, so writers are blocked only while they
	// are deleted.
	type candidate struct {
		h    casstore.Hash
		path string
	}
	var cands []candidate
	err = s.Walk(func(h casstore.Hash, path string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if marks.Has(h) {
			return nil
		}
		fi, err := os.Lstat(path)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if fi.ModTime().After(cutoff) {
			res.Young++
			return nil
		}
		if opts.DryRun {
			res.Swept++
			res.BytesFreed += fi.Size()
			return nil
		}
		cands = append(cands, candidate{h, path})
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("gc: list objects: %w", err)
	}
	if opts.DryRun {
		res.finish(roots, marks)
		return res, nil
	}

	if testHookBeforeLock != nil {
		testHookBeforeLock()
	}
	unlock, err := s.LockExclusive()
	if err != nil {
		return res, fmt.Errorf("gc: %w", err)
	}
	defer unlock()
	// Forks may have moved to roots written since the mark phase. Mark those too; only
	// the new parts are walked.
	more, err := liveRoots(src, opts.Roots)
	if err != nil {
		return res, err
	}
	if err := marks.Extend(ctx, s, more); err != nil {
		return res, err
	}
	if err := unreadable(marks); err != nil {
		return res, err
	}
	roots = append(roots, more...)
	// Decide first, then tell the size index, durably, which objects are about to
	// go (it must never claim an object the sweep removed), then remove them.
	type victim struct {
		candidate
		size int64
	}
	var victims []victim
	for _, c := range cands {
		if err := ctx.Err(); err != nil {
			res.finish(roots, marks)
			return res, err
		}
		if marks.Has(c.h) {
			continue
		}
		fi, err := os.Lstat(c.path)
		if err != nil {
			continue // already gone
		}
		if fi.ModTime().After(cutoff) { // reused by a batch since it was listed
			res.Young++
			continue
		}
		victims = append(victims, victim{c, fi.Size()})
	}
	forget := make([]casstore.Hash, len(victims))
	for i, v := range victims {
		forget[i] = v.h
	}
	if err := s.ForgetSizes(forget); err != nil {
		res.finish(roots, marks)
		return res, fmt.Errorf("gc: %w", err)
	}
	for _, v := range victims {
		if err := os.Remove(v.path); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			res.finish(roots, marks)
			return res, fmt.Errorf("gc: remove object %s: %w", v.h, err)
		}
		res.Swept++
		res.BytesFreed += v.size
	}
	if err := s.CompactSizes(); err != nil {
		log.G(ctx).WithError(err).Warn("gc: size index not compacted")
	}
	// Fan-out directories stay even when empty: other processes cache their existence.
	n, err := s.SweepTemp(grace)
	res.TempSwept = n
	res.finish(roots, marks)
	if err != nil {
		return res, fmt.Errorf("gc: %w", err)
	}
	log.G(ctx).WithField("swept", res.Swept).WithField("bytes", res.BytesFreed).
		WithField("marked", res.Marked).WithField("missing", len(res.Missing)).Debug("garbage collection done")
	return res, nil
}

// testHookBeforeLock lets tests act in the window between listing candidates and
// taking the exclusive lock, where a concurrent commit can reuse or revive objects.
var testHookBeforeLock func()

func (r *Result) finish(roots []casstore.Hash, m *Marks) {
	seen := map[casstore.Hash]struct{}{}
	for _, h := range roots {
		seen[h] = struct{}{}
	}
	r.Roots = len(seen)
	r.Marked = m.Len()
	r.Missing = m.Missing
	r.Undecodable = m.Undecodable
}

func liveRoots(src RootSource, extra []casstore.Hash) ([]casstore.Hash, error) {
	roots := append([]casstore.Hash(nil), extra...)
	if src == nil {
		return roots, nil
	}
	live, err := src.LiveRoots()
	if err != nil {
		return nil, fmt.Errorf("gc: list live roots: %w", err)
	}
	return append(roots, live...), nil
}

func unreadable(m *Marks) error {
	if len(m.Unreadable) == 0 {
		return nil
	}
	var b strings.Builder
	for i, p := range m.Unreadable {
		if i == 3 {
			fmt.Fprintf(&b, "; and %d more", len(m.Unreadable)-i)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(p.String())
	}
	return fmt.Errorf("gc: nothing swept: %d reachable tree(s) cannot be read, so what they reach is unknown (`tidepool fsck --quarantine` moves corrupt objects aside): %s: %w",
		len(m.Unreadable), b.String(), ErrUnreadableTrees)
}

// quote renders a path for a one-line message, quoting it only when it holds
// characters that would break the line or be ambiguous.
func quote(p string) string {
	for _, r := range p {
		if r < 0x20 || r == 0x7f || r == '"' || r == '\\' || r == 0xfffd {
			return strconv.Quote(p)
		}
	}
	return p
}

package snapshotter

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// Fork labels a branch carries besides the caller's.
const (
	// ForkLabelBranchOf names the snapshot a branch was taken from.
	ForkLabelBranchOf = "tidepool.dev/branch-of"
)

// branchBuffer is how much of a branch's new content is held in memory while the
// container is frozen, so the freeze lasts for reading it, not for writing it to
// the store too; beyond it files are staged on disk during the freeze.
const branchBuffer = 64 << 20

// MaxBranches bounds how many forks one Branch makes.
const MaxBranches = 64

// BranchRequest asks for a live snapshot's current changes under its workdir as new
// forks, while whatever writes to it (a container) keeps running.
type BranchRequest struct {
	// Key names the snapshot; if empty, Rootfs (its mounts, as containerd gives
	// them) identifies it.
	Key    string
	Rootfs []mount.Mount
	// Count is how many forks to make (1 if 0).
	Count int
	// Label labels a single branch; with Count > 1 the branches are Label-1 ...
	// Label-N. Empty: unlabelled.
	Label  string
	Labels map[string]string
	TTL    time.Duration
	// RequestID, if set, makes the call idempotent: branch i is created with the
	// request id RequestID/i, so a retry returns the forks the first call made.
	RequestID string
	// Reason is recorded in each branch's history ("branch of container ...").
	Reason string
	// Freeze, if set, stops the snapshot's writers (freezes the container) and
	// returns the function that resumes them. It is called with the snapshot
	// locked, right before the walk; the returned thaw runs as soon as every
	// changed file has been read, and in any case before Branch returns.
	Freeze func(ctx context.Context) (thaw func() error, err error)
}

// BranchResult is what a Branch made.
type BranchResult struct {
	Key string
	// ForkID and Base are the snapshot's own binding, which Branch leaves as it is:
	// its changes still go to ForkID when it is removed.
	ForkID string
	Base   casstore.Hash
	// Root is the tree the snapshot's workdir showed while frozen; every branch is
	// at it.
	Root  casstore.Hash
	Forks []*forks.Fork
	// Paused is how long the writers were frozen; Walk how long the walk that read
	// the changes took (it ends the pause); Total the whole call.
	Paused, Walk, Total time.Duration
	// Freeze is how long Freeze took to stop the writers; Publish the time from the
	// thaw to the records (trees written, objects synced); Record the fork records.
	Freeze, Publish, Record time.Duration
	Stats                   ingest.Stats
}

// Branch commits an active fork-bearing snapshot's current changes under its
// workdir, on top of the root it was bound at, into Count new forks, without
// touching the snapshot: its fork record, labels and upper directory stay as they
// are, and its own commit on removal is unaffected (the objects the walk stores
// are content-addressed, so that commit reuses them). The walk is the one Remove
// commits with, over the live upper directory, O(changed); the writers are frozen
// only while it reads.
func (s *Snapshotter) Branch(ctx context.Context, req BranchRequest) (_ BranchResult, retErr error) {
	start := time.Now()
	if req.Count == 0 {
		req.Count = 1
	}
	if req.Count < 0 || req.Count > MaxBranches {
		return BranchResult{}, fmt.Errorf("branch count %d: want 1 to %d: %w", req.Count, MaxBranches, errdefs.ErrInvalidArgument)
	}
	if req.TTL < 0 {
		return BranchResult{}, fmt.Errorf("branch ttl %s is negative: %w", req.TTL, errdefs.ErrInvalidArgument)
	}
	key := req.Key
	if key == "" {
		var err error
		if key, err = s.KeyFromMounts(ctx, req.Rootfs); err != nil {
			return BranchResult{}, err
		}
	}
	s.locks.Lock(key)
	defer s.locks.Unlock(key)
	if err := s.recordPending(ctx, key); err != nil {
		return BranchResult{}, fmt.Errorf("branch %s: %w", key, err)
	}
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return BranchResult{}, fmt.Errorf("branch %s: %w", key, err)
	}
	b, ok, err := s.parseBound(info)
	switch {
	case err != nil:
		return BranchResult{}, fmt.Errorf("branch %s: %w", key, err)
	case !ok:
		return BranchResult{}, fmt.Errorf("branch %s: the snapshot has no source fork (no %s label or annotation): %w", key, binding.LabelFork, errdefs.ErrFailedPrecondition)
	case !b.isBound():
		return BranchResult{}, fmt.Errorf("branch %s: the snapshot waits for its fork (an idle pool member): %w", key, errdefs.ErrFailedPrecondition)
	case sn.Kind != snapshots.KindActive:
		return BranchResult{}, fmt.Errorf("branch %s: a %s snapshot has no changes to branch: %w", key, sn.Kind, errdefs.ErrFailedPrecondition)
	}
	reqs := make([]forks.CreateRequest, req.Count)
	for i := range reqs {
		labels := make(map[string]string, len(req.Labels)+1)
		for k, v := range req.Labels {
			labels[k] = v
		}
		labels[ForkLabelBranchOf] = key
		r := forks.CreateRequest{Base: b.base, Label: req.Label, TTL: req.TTL, Labels: labels}
		if req.Count > 1 && req.Label != "" {
			r.Label = fmt.Sprintf("%s-%d", req.Label, i+1)
		}
		if req.RequestID != "" {
			r.RequestID = fmt.Sprintf("%s/%d", req.RequestID, i+1)
		}
		reqs[i] = r
	}
	reason := req.Reason
	if reason == "" {
		reason = "branch of snapshot " + key
	}

	res := BranchResult{Key: key, ForkID: b.forkID, Base: b.base}
	var (
		thawOnce sync.Once
		thawErr  error
		frozenAt time.Time
		thawFn   func() error
	)
	thaw := func() {
		thawOnce.Do(func() {
			if thawFn == nil {
				return
			}
			thawErr = thawFn()
			res.Paused = time.Since(frozenAt)
		})
	}
	defer func() {
		thaw()
		if thawErr != nil {
			log.G(ctx).WithError(thawErr).WithField("key", key).Error("branch: could not resume the snapshot's writers")
			if retErr == nil {
				retErr = fmt.Errorf("branch %s: resume: %w", key, thawErr)
			}
		}
	}()
	if req.Freeze != nil {
		frozenAt = time.Now()
		if thawFn, err = req.Freeze(ctx); err != nil {
			thawFn = nil
			return BranchResult{}, fmt.Errorf("branch %s: freeze: %w", key, err)
		}
		res.Freeze = time.Since(frozenAt)
	}
	walkStart := time.Now()
	var readAt time.Time
	opts := ingest.Options{
		BufferBytes: branchBuffer,
		Read: func() {
			readAt = time.Now()
			res.Walk = readAt.Sub(walkStart)
			thaw()
		},
		Record: func(root casstore.Hash) error {
			if thawErr != nil {
				return fmt.Errorf("resume: %w", thawErr)
			}
			recordAt := time.Now()
			res.Publish = recordAt.Sub(readAt)
			fs, err := s.forks.CreateAt(ctx, reqs, root, reason)
			res.Forks, res.Record = fs, time.Since(recordAt)
			return err
		},
	}
	upper, prefix, lowers, err := s.changes(sn, b)
	if err != nil {
		return BranchResult{}, fmt.Errorf("branch %s: %w", key, err)
	}
	opts.Lowers = lowers
	root, st, err := ingest.UpperStats(ctx, s.store, b.base, upper, prefix, opts)
	if err != nil {
		return BranchResult{}, fmt.Errorf("branch %s: %w", key, err)
	}
	res.Root, res.Stats, res.Total = root, st, time.Since(start)
	s.metrics.branchSeconds.Observe(res.Total.Seconds())
	s.metrics.branchPausedSeconds.Observe(res.Paused.Seconds())
	log.G(ctx).WithField("key", key).WithField("root", root.Short()).WithField("forks", len(res.Forks)).
		WithField("paused", res.Paused).WithField("freeze", res.Freeze).WithField("walk", res.Walk).
		WithField("publish", res.Publish).WithField("record", res.Record).WithField("total", res.Total).Debug("branched snapshot")
	return res, nil
}

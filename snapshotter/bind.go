package snapshotter

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// BindRequest asks for a fork to be placed in an existing active snapshot. Fork,
// Workdir and Owner mean what the tidepool snapshot labels mean; empty Workdir and
// Owner take the defaults.
type BindRequest struct {
	// Key names the snapshot; if empty, Rootfs (the mounts containerd computed for
	// it, as a runtime shim sees them) identifies it.
	Key     string
	Rootfs  []mount.Mount
	Fork    string
	Workdir string
	Owner   string
	Discard bool
}

// BindResult is the binding in force and the snapshot's mounts with the view in place.
type BindResult struct {
	Key    string
	ForkID string
	Root   casstore.Hash
	Mounts []mount.Mount
}

// Bind binds a fork to an active snapshot before its rootfs is mounted (or, for a
// snapshot prepared late-bound, to its already mounted empty view). Binding the same
// fork again returns the binding in force; a different fork is a conflict.
func (s *Snapshotter) Bind(ctx context.Context, req BindRequest) (BindResult, error) {
	key := req.Key
	if key == "" {
		var err error
		if key, err = s.KeyFromMounts(ctx, req.Rootfs); err != nil {
			return BindResult{}, err
		}
	}
	labels := map[string]string{binding.LabelFork: req.Fork}
	if req.Workdir != "" {
		labels[binding.LabelWorkdir] = req.Workdir
	}
	if req.Owner != "" {
		labels[binding.LabelOwner] = req.Owner
	}
	if req.Discard {
		labels[binding.LabelDiscard] = "true"
	}
	want, _, err := binding.Parse(labels, binding.LabelKeys, s.defaults)
	if err != nil {
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}

	s.locks.Lock(key)
	unlock := func() { s.locks.Unlock(key) }
	defer func() {
		if unlock != nil {
			unlock()
		}
	}()
	if err := s.recordPending(ctx, key); err != nil {
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	if sn.Kind != snapshots.KindActive {
		return BindResult{}, fmt.Errorf("bind %s: only an active snapshot takes a fork: %w", key, errdefs.ErrFailedPrecondition)
	}
	have, ok, err := s.parseBound(info)
	if err != nil {
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	switch {
	case ok && have.isBound():
		if err := s.agrees(ctx, have, want, req); err != nil {
			return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
		}
		if have.spec.Slot { // its fork is on the slot; the rootfs is as prepared
			mounts, err := s.overlay.Mounts(ctx, key)
			if err != nil {
				return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
			}
			return BindResult{Key: key, ForkID: have.forkID, Root: have.base, Mounts: mounts}, nil
		}
		if err := s.ensureView(ctx, sn, have); err != nil {
			return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
		}
		mounts, err := s.forkMounts(sn)
		if err != nil {
			return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
		}
		return BindResult{Key: key, ForkID: have.forkID, Root: have.base, Mounts: mounts}, nil
	case ok: // prepared late-bound: the view is in the overlay already, with its prefix and owner
		if req.Workdir != "" && want.Workdir != have.spec.Workdir {
			return BindResult{}, fmt.Errorf("bind %s: workdir %s differs from %s, where the snapshot's view was prepared: %w", key, want.Workdir, have.spec.Workdir, errdefs.ErrConflict)
		}
		if have.spec.Slot {
			return s.bindSlot(ctx, key, sn, have, want, &unlock)
		}
		return s.bindLate(ctx, key, sn, have, want, &unlock)
	default:
		return s.bindFresh(ctx, key, sn, want)
	}
}

// agrees checks that a second request names the binding already in force.
func (s *Snapshotter) agrees(ctx context.Context, have bound, want binding.Spec, req BindRequest) error {
	same := want.Fork == have.spec.Fork || want.Fork == have.forkID
	if !same {
		if h, err := casstore.ParseHash(want.Fork); err == nil {
			same = h == have.base
		} else if f, err := s.forks.Get(ctx, want.Fork); err == nil {
			same = f.ID == have.forkID
		}
	}
	if !same {
		return fmt.Errorf("the snapshot is bound to fork %q (fork record %s) and the request names %q: %w", have.spec.Fork, have.forkID, want.Fork, errdefs.ErrConflict)
	}
	if req.Workdir != "" && want.Workdir != have.spec.Workdir {
		return fmt.Errorf("the snapshot's fork is at %s and the request names workdir %s: %w", have.spec.Workdir, want.Workdir, errdefs.ErrConflict)
	}
	return nil
}

func (s *Snapshotter) bindFresh(ctx context.Context, key string, sn storage.Snapshot, want binding.Spec) (_ BindResult, retErr error) {
	forkID, root, isNew, err := s.resolveFork(ctx, want.Fork, key)
	if err != nil {
		return BindResult{}, fmt.Errorf("bind %s: fork %q: %w", key, want.Fork, err)
	}
	defer func() {
		if retErr != nil && isNew {
			_ = s.forks.Remove(context.WithoutCancel(ctx), forkID)
		}
	}()
	b := bound{spec: want, forkID: forkID, base: root}
	if err := s.pinAndMount(ctx, sn, key, b); err != nil {
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	mounts, err := s.forkMounts(sn)
	if err != nil {
		if uerr := s.views.Unmount(context.WithoutCancel(ctx), s.viewDir(sn.ID)); uerr != nil {
			log.G(ctx).WithError(uerr).Warn("could not unmount the view of a failed bind")
		}
		_ = s.forks.Unpin(pinName(key))
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	labels := map[string]string{
		binding.LabelFork: want.Fork, binding.LabelWorkdir: want.Workdir, binding.LabelOwner: want.Owner(),
		labelForkID: forkID, labelBase: root.String(),
	}
	if want.Discard {
		labels[binding.LabelDiscard] = "true"
	}
	if err := s.setLabels(ctx, key, labels); err != nil {
		if uerr := s.views.Unmount(context.WithoutCancel(ctx), s.viewDir(sn.ID)); uerr != nil {
			log.G(ctx).WithError(uerr).Warn("could not unmount the view of a failed bind")
		}
		_ = s.forks.Unpin(pinName(key))
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	s.metrics.binds.WithLabelValues("api").Inc()
	return BindResult{Key: key, ForkID: forkID, Root: root, Mounts: mounts}, nil
}

// forkToBind resolves the fork a late or slot bind names (creating it from a root)
// and takes the store's hold with the fork's root present. The root's pin is written
// behind the claim (record.go); until it is durable the hold stays taken, so no
// collection runs without it: release it (hold) once the bind failed or its record
// landed. undo removes a fork the resolution created, for a bind that failed.
func (s *Snapshotter) forkToBind(ctx context.Context, key string, want binding.Spec) (forkID string, root casstore.Hash, hold, undo func(), err error) {
	forkID, root, isNew, err := s.resolveFork(ctx, want.Fork, key)
	if err != nil {
		return "", root, nil, nil, fmt.Errorf("bind %s: fork %q: %w", key, want.Fork, err)
	}
	undo = func() {
		if isNew {
			_ = s.forks.Remove(context.WithoutCancel(ctx), forkID)
		}
	}
	if hold, err = s.store.Hold(); err != nil {
		undo()
		return "", root, nil, nil, fmt.Errorf("bind %s: pin root: %w", key, err)
	}
	if ok, err := s.store.Has(root); err != nil || !ok {
		hold()
		undo()
		if err == nil {
			err = forks.ErrRootGone
		}
		return "", root, nil, nil, fmt.Errorf("bind %s: pin root %s: %w", key, root, err)
	}
	return forkID, root, hold, undo, nil
}

// bindLate binds a fork to a snapshot prepared late-bound. Once the view is bound
// it takes over the release of key's lock (*unlock), which it hands to the write of
// the binding's labels behind the claim (record.go).
func (s *Snapshotter) bindLate(ctx context.Context, key string, sn storage.Snapshot, have bound, want binding.Spec, unlock *func()) (_ BindResult, retErr error) {
	forkID, root, hold, undo, err := s.forkToBind(ctx, key, want)
	if err != nil {
		return BindResult{}, err
	}
	defer func() {
		if retErr != nil {
			undo()
		}
	}()
	dir := s.viewDir(sn.ID)
	if err := s.ensureView(ctx, sn, have); err != nil {
		hold()
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	mounts, err := s.forkMounts(sn)
	if err != nil {
		hold()
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	if err := s.views.Bind(ctx, dir, root); err != nil {
		hold()
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	s.recordBind(ctx, key, forkID, root, want, hold, unlock, "late")
	return BindResult{Key: key, ForkID: forkID, Root: root, Mounts: mounts}, nil
}

// recordBind finishes a late or slot bind that is in place: the binding's labels
// and the root's pin are written behind the claim (record.go), which then releases
// the store's hold and key's lock, taken over from the caller (*unlock).
func (s *Snapshotter) recordBind(ctx context.Context, key, forkID string, root casstore.Hash, want binding.Spec, hold func(), unlock *func(), entrance string) {
	labels := map[string]string{labelForkID: forkID, labelBase: root.String()}
	if want.Discard {
		labels[binding.LabelDiscard] = "true"
	}
	release := *unlock
	*unlock = nil
	s.recordBehind(ctx, key, bindRecord{pin: root, labels: labels}, func() { hold(); release() })
	s.metrics.binds.WithLabelValues(entrance).Inc()
}

func (s *Snapshotter) setLabels(ctx context.Context, key string, labels map[string]string) error {
	info := snapshots.Info{Name: key, Labels: labels}
	var paths []string
	for k := range labels {
		paths = append(paths, "labels."+k)
	}
	// What the overlay snapshotter's Update does, in a transaction shared with
	// concurrent binds.
	return s.labelWrites.Do(func(ctx context.Context) error {
		_, err := storage.UpdateInfo(ctx, info, paths...)
		return err
	})
}

// KeyFromMounts recognises one of this snapshotter's active snapshots from the mounts
// containerd computed for it (as a shim or a containerd client sees them): the upper
// directory (or bind source) is <root>/snapshots/<id>/fs.
func (s *Snapshotter) KeyFromMounts(ctx context.Context, mounts []mount.Mount) (string, error) {
	var upper string
	for _, m := range mounts {
		switch m.Type {
		case "overlay":
			for _, o := range m.Options {
				if v, ok := strings.CutPrefix(o, "upperdir="); ok {
					upper = v
				}
			}
		case "bind":
			upper = m.Source
		}
	}
	if upper == "" {
		return "", fmt.Errorf("the rootfs mounts name no upper directory, so they are not a tidepool snapshot's: %w", errdefs.ErrInvalidArgument)
	}
	rel, err := filepath.Rel(filepath.Join(s.root, "snapshots"), filepath.Clean(upper))
	id, fsDir, _ := strings.Cut(rel, string(filepath.Separator))
	if err != nil || fsDir != "fs" || id == "" || strings.HasPrefix(rel, "..") {
		return "", fmt.Errorf("rootfs upper directory %s is not a tidepool snapshot under %s: %w", upper, s.root, errdefs.ErrInvalidArgument)
	}
	var ids map[string]string
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		ids, err = storage.IDMap(ctx)
		return err
	}); err != nil {
		return "", err
	}
	key, ok := ids[id]
	if !ok {
		return "", fmt.Errorf("no snapshot with id %s: %w", id, errdefs.ErrNotFound)
	}
	return key, nil
}

// SnapshotBinding describes one snapshot and the fork it carries, for listings.
type SnapshotBinding struct {
	Key, ID, Kind, Parent string
	Fork, ForkID          string
	Root                  casstore.Hash
	Workdir, Owner        string
	Discard, LateBound    bool
	ViewMounted           bool
}

// List describes every snapshot, with its fork binding if it has one.
func (s *Snapshotter) List(ctx context.Context) ([]SnapshotBinding, error) {
	var out []SnapshotBinding
	err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		return storage.WalkInfo(ctx, func(ctx context.Context, info snapshots.Info) error {
			id, _, _, err := storage.GetInfo(ctx, info.Name)
			if err != nil {
				return err
			}
			sb := SnapshotBinding{Key: info.Name, ID: id, Kind: info.Kind.String(), Parent: info.Parent}
			if b, ok, err := s.parseBound(info); err == nil && ok {
				sb.Fork, sb.ForkID, sb.Root = b.spec.Fork, b.forkID, b.base
				sb.Workdir, sb.Owner, sb.Discard, sb.LateBound = b.spec.Workdir, b.spec.Owner(), b.spec.Discard, b.spec.LateBind
				sb.ViewMounted = s.views.Mounted(ctx, s.viewDir(id))
			}
			out = append(out, sb)
			return nil
		})
	})
	return out, err
}

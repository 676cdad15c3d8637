package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay/overlayutils"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/moby/locker"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/internal/groupcommit"
)

// Labels the snapshotter keeps on a fork-bearing snapshot next to the request's own:
// the fork record it commits to and the root it was bound at (the commit's base).
const (
	labelForkID = binding.LabelPrefix + "fork-id"
	labelBase   = binding.LabelPrefix + "base"
)

// ForkStore is what the snapshotter needs from the fork database: records to bind and
// advance, and pins that keep a bound root alive while a snapshot uses it.
type ForkStore interface {
	forks.Service
	// CreateAt makes forks of a base already advanced to root, in one transaction.
	CreateAt(ctx context.Context, reqs []forks.CreateRequest, root casstore.Hash, reason string) ([]*forks.Fork, error)
	Pin(name string, root casstore.Hash) error
	Unpin(name string) error
}

// Config configures a Snapshotter.
type Config struct {
	// Root holds metadata.db, snapshots/<id>/{fs,work} (the overlay snapshotter's
	// layout) and views/<id>, the fork view mountpoints.
	Root string
	// MountOptions are extra overlay options, as in the overlay snapshotter.
	MountOptions []string
	// AsyncRemove defers directory removal to Cleanup, as the overlay plugin does
	// unless sync_remove is set.
	AsyncRemove bool
	// Defaults fill the workdir and owner a request leaves out.
	Defaults binding.Defaults
	// Remote, if set, serves "remote:NAME" forks and roots missing locally, and
	// receives the commits of forks made from remote refs.
	Remote Remote
	// ViewLayering is how a kernel view enters the container's overlay:
	// LayeringDirect (the default) or LayeringNested.
	ViewLayering string
}

// How a kernel view enters a container's overlay.
const (
	// LayeringDirect: the view's EROFS image, mounted alone, is the overlay's top
	// lower layer and the object directory its data-only layer
	// (lowerdir=IMAGE:LAYERS...::OBJECTS, metacopy=on, redirect_dir=on, no
	// userxattr). One overlay fewer on every lookup and read. Snapshots whose option
	// string would not fit in a page, and hosts whose overlay options rule out
	// metacopy (userxattr), fall back to nested.
	LayeringDirect = "direct"
	// LayeringNested: the view's own overlay (image + object directory) is the
	// container overlay's top lower layer, with the overlay snapshotter's options.
	LayeringNested = "nested"
)

// Snapshotter implements snapshots.Snapshotter.
type Snapshotter struct {
	root     string
	ms       *storage.MetaStore
	overlay  snapshots.Snapshotter
	store    *casstore.Store
	forks    ForkStore
	views    ViewHost
	defaults binding.Defaults
	options  []string
	locks    *locker.Locker
	metrics  *Metrics
	remote   Remote
	// labelWrites commits concurrent label updates (a burst of claims binding their
	// forks) in shared metadata transactions: see groupcommit.
	labelWrites *groupcommit.Group[context.Context]
	records     bindRecords // binds recorded behind their claims (record.go)
	// direct: kernel views are layered directly into containers' overlays
	// (LayeringDirect) where a snapshot's options allow it.
	direct bool
	// arrivals prepares the views of roots as they arrive (arrival.go).
	arrivals *arrivals
}

var _ snapshots.Snapshotter = (*Snapshotter)(nil)

// New opens the snapshotter at cfg.Root. Views still mounted for existing snapshots
// (kernel views outlive the process) are adopted as they are; views left by a FUSE
// server that died are detached and mounted again on the snapshot's first Mounts;
// views of snapshots that no longer exist are removed.
func New(ctx context.Context, cfg Config, store *casstore.Store, fk ForkStore, views ViewHost) (*Snapshotter, error) {
	if err := os.MkdirAll(filepath.Join(cfg.Root, "views"), 0o700); err != nil {
		return nil, fmt.Errorf("create snapshotter root: %w", err)
	}
	ms, err := storage.NewMetaStore(filepath.Join(cfg.Root, "metadata.db"))
	if err != nil {
		return nil, fmt.Errorf("open snapshot metadata: %w", err)
	}
	options, err := mountOptions(cfg.Root, cfg.MountOptions)
	if err != nil {
		ms.Close()
		return nil, err
	}
	direct, err := directLayering(cfg.ViewLayering, options)
	if err != nil {
		ms.Close()
		return nil, err
	}
	opts := []overlay.Opt{overlay.WithMetaStore(ms), overlay.WithMountOptions(options)}
	if cfg.AsyncRemove {
		opts = append(opts, overlay.AsynchronousRemove)
	}
	ov, err := overlay.NewSnapshotter(cfg.Root, opts...)
	if err != nil {
		ms.Close()
		return nil, fmt.Errorf("open overlay snapshotter: %w", err)
	}
	s := &Snapshotter{
		root: cfg.Root, ms: ms, overlay: ov, store: store, forks: fk, views: views,
		defaults: cfg.Defaults, options: options, locks: locker.New(), metrics: newMetrics(),
		remote: cfg.Remote, direct: direct,
	}
	s.arrivals = newArrivals(ctx, views, s.metrics, filepath.Join(cfg.Root, "view-shapes.json"))
	s.labelWrites = &groupcommit.Group[context.Context]{Commit: func(apply func(context.Context) error) error {
		return ms.WithTransaction(context.WithoutCancel(ctx), true, apply)
	}}
	s.detachStaleViews(ctx)
	// Views (kernel ones outlive the process) of snapshots removed while no
	// snapshotter ran have no owner now.
	if err := s.removeOrphanViewDirs(ctx); err != nil {
		log.G(ctx).WithError(err).Warn("could not remove views of removed snapshots")
	}
	return s, nil
}

// mountOptions applies the overlay snapshotter's defaults once, so that overlay mounts
// of plain snapshots and of fork-bearing ones carry the same options.
func mountOptions(root string, configured []string) ([]string, error) {
	options := append([]string(nil), configured...)
	if !hasOption(options, "userxattr") {
		need, err := overlayutils.NeedsUserXAttr(root)
		if err != nil {
			log.L.WithError(err).Warn("cannot tell whether overlay needs userxattr; assuming not")
		}
		if need {
			options = append(options, "userxattr")
		}
	}
	if !hasOption(options, "index") {
		if _, err := os.Stat("/sys/module/overlay/parameters/index"); err == nil {
			options = append(options, "index=off")
		}
	}
	return options, nil
}

// directLayering says whether kernel views are layered directly: asked for, and the
// overlay options leave metacopy and redirect_dir to the snapshotter and trusted
// xattrs in use (overlayfs refuses metacopy with userxattr; an image's xattrs are
// trusted.overlay.*).
func directLayering(layering string, options []string) (bool, error) {
	switch layering {
	case "", LayeringDirect:
	case LayeringNested:
		return false, nil
	default:
		return false, fmt.Errorf("view layering %q: want %q or %q: %w", layering, LayeringDirect, LayeringNested, errdefs.ErrInvalidArgument)
	}
	for _, o := range []string{"userxattr", "metacopy", "redirect_dir"} {
		if hasOption(options, o) {
			log.L.WithField("option", o).Info("overlay option set: kernel views are layered nested, not directly")
			return false, nil
		}
	}
	return true, nil
}

func hasOption(options []string, key string) bool {
	for _, o := range options {
		if o == key || strings.HasPrefix(o, key+"=") {
			return true
		}
	}
	return false
}

func (s *Snapshotter) upperPath(id string) string {
	return filepath.Join(s.root, "snapshots", id, "fs")
}
func (s *Snapshotter) workPath(id string) string {
	return filepath.Join(s.root, "snapshots", id, "work")
}
func (s *Snapshotter) viewDir(id string) string { return filepath.Join(s.root, "views", id) }

// Metrics exposes the snapshotter's Prometheus collectors.
func (s *Snapshotter) Metrics() *Metrics { return s.metrics }

// Stat delegates to the overlay snapshotter.
func (s *Snapshotter) Stat(ctx context.Context, key string) (snapshots.Info, error) {
	return s.overlay.Stat(ctx, key)
}

// Update delegates; the binding labels are the snapshotter's to set.
func (s *Snapshotter) Update(ctx context.Context, info snapshots.Info, fieldpaths ...string) (snapshots.Info, error) {
	for _, fp := range fieldpaths {
		if k, ok := strings.CutPrefix(fp, "labels."); ok && strings.HasPrefix(k, binding.LabelPrefix) {
			return snapshots.Info{}, fmt.Errorf("label %s is set at prepare or through tidepool's bind API, not by update: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	return s.overlay.Update(ctx, info, fieldpaths...)
}

// Usage delegates: a fork-bearing snapshot uses what its upper directory holds.
func (s *Snapshotter) Usage(ctx context.Context, key string) (snapshots.Usage, error) {
	return s.overlay.Usage(ctx, key)
}

// Walk delegates.
func (s *Snapshotter) Walk(ctx context.Context, fn snapshots.WalkFunc, filters ...string) error {
	return s.overlay.Walk(ctx, fn, filters...)
}

// Prepare creates an active snapshot; with tidepool labels its rootfs gets the fork.
func (s *Snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	return s.create(ctx, snapshots.KindActive, key, parent, opts)
}

// View creates a read-only snapshot; with tidepool labels it shows the fork too.
func (s *Snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	return s.create(ctx, snapshots.KindView, key, parent, opts)
}

func (s *Snapshotter) create(ctx context.Context, kind snapshots.Kind, key, parent string, opts []snapshots.Opt) (_ []mount.Mount, retErr error) {
	var req snapshots.Info
	for _, o := range opts {
		if err := o(&req); err != nil {
			return nil, err
		}
	}
	spec, ok, err := binding.Parse(req.Labels, binding.LabelKeys, s.defaults)
	if err != nil {
		return nil, fmt.Errorf("prepare %s: %w", key, err)
	}
	delegate := s.overlay.Prepare
	if kind == snapshots.KindView {
		delegate = s.overlay.View
	}
	if !ok {
		return delegate(ctx, key, parent, opts...)
	}
	for _, k := range []string{labelForkID, labelBase} {
		if _, set := req.Labels[k]; set {
			return nil, fmt.Errorf("prepare %s: label %s is reserved for the snapshotter: %w", key, k, errdefs.ErrInvalidArgument)
		}
	}
	if _, set := req.Labels[snapshots.LabelSnapshotUIDMapping]; set {
		return nil, fmt.Errorf("prepare %s: user namespace remapping is not supported with a fork: %w", key, errdefs.ErrNotImplemented)
	}
	s.locks.Lock(key)
	defer s.locks.Unlock(key)

	extra := map[string]string{}
	var created string
	if !spec.LateBind {
		// The view's costly part (a kernel view's image) starts as soon as the root is
		// known, alongside the fork record, the overlay snapshot and the pin; the mount
		// below joins it. It never outlives this call.
		prebuilt := func() {}
		defer func() { prebuilt() }()
		forkID, root, isNew, err := s.resolveForkThen(ctx, spec.Fork, key, func(root casstore.Hash) {
			vs := ViewSpec{Root: root, Prefix: spec.Prefix(), UID: spec.UID, GID: spec.GID}
			s.arrivals.seen(vs)
			prebuilt = s.prebuild(ctx, vs)
		})
		if err != nil {
			return nil, fmt.Errorf("prepare %s: invalid %s=%q: %w", key, binding.LabelFork, spec.Fork, err)
		}
		if isNew {
			created = forkID
		}
		extra[labelForkID], extra[labelBase] = forkID, root.String()
	}
	defer func() {
		if retErr != nil && created != "" {
			if err := s.forks.Remove(context.WithoutCancel(ctx), created); err != nil {
				log.G(ctx).WithError(err).WithField("fork", created).Warn("could not remove the fork record of a failed prepare")
			}
		}
	}()
	if _, err := delegate(ctx, key, parent, append(opts, snapshots.WithLabels(extra))...); err != nil {
		return nil, err
	}
	sn, info, err := s.get(ctx, key)
	var b bound
	if err == nil {
		b, _, err = s.parseBound(info)
	}
	var mounts []mount.Mount
	switch {
	case err != nil:
	case b.spec.Slot:
		// No view in the rootfs: the fork is mounted onto the slot at bind (slot.go).
		if err = s.ensureSlot(sn.ID); err == nil {
			mounts, err = s.overlay.Mounts(ctx, key)
		}
	default:
		if err = s.pinAndMount(ctx, sn, key, b); err == nil {
			mounts, err = s.forkMounts(sn)
		}
	}
	if err != nil {
		if b.spec.Slot {
			if uerr := s.unmountSlot(context.WithoutCancel(ctx), sn.ID); uerr != nil {
				log.G(ctx).WithError(uerr).WithField("key", key).Warn("could not remove the slot of a failed prepare")
			}
		}
		if rerr := s.overlay.Remove(context.WithoutCancel(ctx), key); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("key", key).Warn("could not remove the snapshot of a failed prepare")
		}
		return nil, fmt.Errorf("prepare %s: %w", key, err)
	}
	s.metrics.binds.WithLabelValues("label").Inc()
	return mounts, nil
}

// bound is a fork-bearing snapshot's binding as recorded in its labels.
type bound struct {
	spec   binding.Spec
	forkID string        // "" while a late-bound view waits for its fork
	base   casstore.Hash // the root the view shows and the commit starts from
}

func (b bound) isBound() bool { return b.forkID != "" }

// parseBound reads the binding from a snapshot's labels; ok is false for a snapshot
// without a fork.
func (s *Snapshotter) parseBound(info snapshots.Info) (bound, bool, error) {
	spec, ok, err := binding.Parse(info.Labels, binding.LabelKeys, s.defaults)
	if err != nil || !ok {
		return bound{}, false, err
	}
	b := bound{spec: spec, forkID: info.Labels[labelForkID]}
	if b.isBound() {
		if b.base, err = casstore.ParseHash(info.Labels[labelBase]); err != nil {
			return bound{}, false, fmt.Errorf("snapshot %s: label %s: %w", info.Name, labelBase, err)
		}
	}
	return b, true, nil
}

func pinName(key string) string { return "snapshot/" + key }

// pinAndMount pins the bound root for as long as the snapshot exists and serves its view.
func (s *Snapshotter) pinAndMount(ctx context.Context, sn storage.Snapshot, key string, b bound) error {
	if b.isBound() {
		if err := s.forks.Pin(pinName(key), b.base); err != nil {
			return fmt.Errorf("pin root %s: %w", b.base.Short(), err)
		}
	}
	return s.ensureView(ctx, sn, b)
}

// ensureView serves sn's view unless it is mounted already (a view mounted by an
// earlier process is adopted as it is, image alone or nested).
func (s *Snapshotter) ensureView(ctx context.Context, sn storage.Snapshot, b bound) error {
	dir := s.viewDir(sn.ID)
	if s.views.Mounted(ctx, dir) {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create view mountpoint: %w", err)
	}
	spec := ViewSpec{Root: b.base, Prefix: b.spec.Prefix(), UID: b.spec.UID, GID: b.spec.GID, Image: s.fitsDirect(sn)}
	if err := s.views.Mount(ctx, dir, spec); err != nil {
		return fmt.Errorf("mount fork view at %s: %w", dir, err)
	}
	return nil
}

// resolveFork turns a fork reference into a fork record and its root. A bare root hash
// gets a record of its own, labelled with the snapshot key, so the container's result
// can always be found with `tidepool forks`.
func (s *Snapshotter) resolveFork(ctx context.Context, ref, key string) (forkID string, root casstore.Hash, isNew bool, err error) {
	return s.resolveForkThen(ctx, ref, key, nil)
}

// resolveForkThen is resolveFork calling onRoot (if not nil) with the root once it is
// known to be a usable tree here, before the fork record is written.
func (s *Snapshotter) resolveForkThen(ctx context.Context, ref, key string, onRoot func(casstore.Hash)) (forkID string, root casstore.Hash, isNew bool, err error) {
	if name, ok := binding.RemoteRef(ref); ok {
		forkID, root, isNew, err = s.resolveRemoteFork(ctx, name, key)
		if err == nil && onRoot != nil {
			onRoot(root)
		}
		return forkID, root, isNew, err
	}
	t, err := forks.Resolve(ctx, s.forks, ref)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return "", root, false, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
		}
		return "", root, false, err
	}
	if err := s.hydrateRoot(ctx, t.Root); err != nil {
		return "", root, false, err
	}
	if err := s.checkRoot(t.Root); err != nil {
		return "", root, false, err
	}
	if onRoot != nil {
		onRoot(t.Root)
	}
	if t.Fork != nil {
		return t.Fork.ID, t.Root, false, nil
	}
	f, err := s.forks.Create(ctx, forks.CreateRequest{Base: t.Root, Label: key, Labels: map[string]string{"tidepool.dev/snapshot": key}})
	if err != nil {
		return "", root, false, fmt.Errorf("create fork record: %w", err)
	}
	return f.ID, f.Root, true, nil
}

// checkRoot makes sure the root is a readable tree here before a container is given it.
func (s *Snapshotter) checkRoot(root casstore.Hash) error {
	if _, err := s.store.ReadTree(root); err != nil {
		if errdefs.IsNotFound(err) {
			return fmt.Errorf("root %s is not in the store: %w", root, errdefs.ErrInvalidArgument)
		}
		return fmt.Errorf("root %s is not a usable tree: %v: %w", root, err, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (s *Snapshotter) get(ctx context.Context, key string) (sn storage.Snapshot, info snapshots.Info, err error) {
	err = s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		if sn, err = storage.GetSnapshot(ctx, key); err != nil {
			return err
		}
		_, info, _, err = storage.GetInfo(ctx, key)
		return err
	})
	return sn, info, err
}

// forkMounts is the overlay of a fork-bearing snapshot: the view above the image
// layers, layered as it is mounted (ImageLayer).
func (s *Snapshotter) forkMounts(sn storage.Snapshot) ([]mount.Mount, error) {
	data, image, err := s.views.ImageLayer(s.viewDir(sn.ID))
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: fork view: %w", sn.ID, err)
	}
	mounts := []mount.Mount{{Type: "overlay", Source: "overlay", Options: s.forkOptions(sn, data, image)}}
	if image {
		mounts = append(mounts, noUserspaceView)
	}
	return mounts, nil
}

// noUserspaceView ends the mounts of a directly layered snapshot. containerd (2.4)
// reads a rootfs for user and group lookups without mounting it when it can parse
// the last mount (fsview: an overlay's lowerdir split at ':' and each layer opened
// as a plain directory). That reader cannot follow a data-only layer (the "::"
// separator makes it open "") nor metacopy redirects (an image's files would read
// as holes), so this last mount, a remount without data that mount.All skips, has a
// type it does not know: it then mounts the rootfs read-only for real, with the
// kernel, as the runtime does.
var noUserspaceView = mount.Mount{Type: "none", Source: "none", Options: []string{"remount"}}

// forkOptions are the overlay options of a fork-bearing snapshot. With image, the
// view is a kernel view's image mounted alone: its files are metadata-only copies
// whose redirects name objects in data, the data-only layer after "::".
func (s *Snapshotter) forkOptions(sn storage.Snapshot, data string, image bool) []string {
	lowers := []string{s.viewDir(sn.ID)}
	for _, p := range sn.ParentIDs {
		lowers = append(lowers, s.upperPath(p))
	}
	var options []string
	if sn.Kind == snapshots.KindActive {
		options = append(options, "workdir="+s.workPath(sn.ID), "upperdir="+s.upperPath(sn.ID))
	} else if len(sn.ParentIDs) == 0 {
		lowers = append(lowers, s.upperPath(sn.ID)) // overlay needs two lowers without an upper
	}
	if !image {
		options = append(options, "lowerdir="+strings.Join(lowers, ":"))
		return append(options, s.options...)
	}
	options = append(options, "lowerdir="+strings.Join(lowers, ":")+"::"+data, "metacopy=on", "redirect_dir=on")
	return append(options, s.options...) // without userxattr (directLayering)
}

// fitsDirect says whether sn's kernel view is to be its image alone, layered directly:
// direct layering is on and the option string is short enough for containerd to
// mount as it is. containerd shortens a long lowerdir (from a page less 512 bytes
// on) by moving into the layers' common directory, which a data-only layer defeats;
// a snapshot over that many layers gets a nested view, whose options it can shorten.
func (s *Snapshotter) fitsDirect(sn storage.Snapshot) bool {
	if !s.direct {
		return false
	}
	size := 0
	for _, o := range s.forkOptions(sn, s.store.Root(), true) {
		size += len(o)
	}
	return size < os.Getpagesize()-512
}

// Mounts returns a snapshot's mounts, mounting its view again if this process has not
// served it yet (after a restart).
func (s *Snapshotter) Mounts(ctx context.Context, key string) ([]mount.Mount, error) {
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return s.overlay.Mounts(ctx, key)
	}
	b, ok, err := s.parseBound(info)
	if err != nil {
		return nil, err
	}
	if !ok {
		return s.overlay.Mounts(ctx, key)
	}
	s.locks.Lock(key)
	defer s.locks.Unlock(key)
	if b.spec.Slot {
		if err := s.ensureSlot(sn.ID); err != nil {
			return nil, fmt.Errorf("mounts %s: %w", key, err)
		}
		return s.overlay.Mounts(ctx, key)
	}
	if err := s.ensureView(ctx, sn, b); err != nil {
		return nil, fmt.Errorf("mounts %s: %w", key, err)
	}
	return s.forkMounts(sn)
}

// Commit turns an active snapshot into a layer. A fork-bearing snapshot cannot be one:
// its content spans the view, which no layer holds; its changes go to the fork on Remove.
func (s *Snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	if _, info, err := s.get(ctx, key); err == nil {
		if _, ok, _ := s.parseBound(info); ok {
			return fmt.Errorf("commit %s: a snapshot with a source fork cannot become an image layer; remove it to commit its changes to the fork: %w", key, errdefs.ErrFailedPrecondition)
		}
	}
	return s.overlay.Commit(ctx, name, key, opts...)
}

// Remove commits a fork-bearing snapshot's changes to its fork, then removes it. If
// the commit fails the snapshot stays, so nothing the container wrote is lost.
func (s *Snapshotter) Remove(ctx context.Context, key string) error {
	s.locks.Lock(key)
	defer s.locks.Unlock(key)
	if err := s.recordPending(ctx, key); err != nil {
		return fmt.Errorf("remove %s: %w", key, err)
	}
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return s.overlay.Remove(ctx, key)
	}
	b, ok, err := s.parseBound(info)
	if err != nil {
		return fmt.Errorf("remove %s: %w", key, err)
	}
	if ok {
		if sn.Kind == snapshots.KindActive && b.isBound() && !b.spec.Discard {
			_, root, err := s.commitToFork(ctx, key, sn, b)
			if err != nil {
				s.metrics.commitErrors.Inc()
				return fmt.Errorf("remove %s: commit changes to fork %s: %w (the snapshot is kept; label %s=true discards it)", key, b.forkID, err, binding.LabelDiscard)
			}
			if root != b.base && !b.spec.Slot {
				s.arrivals.committed(ViewSpec{Root: root, Prefix: b.spec.Prefix(), UID: b.spec.UID, GID: b.spec.GID})
			}
		}
		if b.spec.Slot {
			if err := s.unmountSlot(ctx, sn.ID); err != nil {
				return fmt.Errorf("remove %s: %w", key, err)
			}
		}
		if err := s.views.Unmount(ctx, s.viewDir(sn.ID)); err != nil {
			return fmt.Errorf("remove %s: unmount fork view: %w", key, err)
		}
	}
	if err := s.overlay.Remove(ctx, key); err != nil {
		return err
	}
	if ok {
		if err := os.Remove(s.viewDir(sn.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			log.G(ctx).WithError(err).WithField("key", key).Warn("could not remove view mountpoint")
		}
		if err := s.forks.Unpin(pinName(key)); err != nil {
			log.G(ctx).WithError(err).WithField("key", key).Warn("could not unpin the snapshot's root")
		}
	}
	return nil
}

// commitToFork records the upper directory's changes under the workdir as the fork's
// next root and returns the fork that holds them. If the fork moved meanwhile
// (another container bound to the same fork committed first), the result becomes a
// fork of its own rather than overwrite that.
func (s *Snapshotter) commitToFork(ctx context.Context, key string, sn storage.Snapshot, b bound) (string, casstore.Hash, error) {
	start := time.Now()
	// The fork moves inside Record, while the new objects are still held against
	// garbage collection, so a collection can never sweep them before they are live.
	forkID := b.forkID
	record := func(root casstore.Hash) error {
		if root == b.base {
			return nil
		}
		id, err := s.advanceFork(ctx, key, b, root)
		forkID = id
		return err
	}
	upper, prefix, lowers, err := s.changes(sn, b)
	if err != nil {
		return "", b.base, err
	}
	newRoot, err := ingest.Upper(ctx, s.store, b.base, upper, prefix, ingest.Options{Record: record, Lowers: lowers})
	if err != nil {
		return "", newRoot, err
	}
	s.metrics.commitSeconds.Observe(time.Since(start).Seconds())
	logger := log.G(ctx).WithField("key", key).WithField("fork", b.forkID).WithField("root", newRoot.Short())
	switch {
	case newRoot == b.base:
		logger.Debug("no changes under the workdir; fork unchanged")
	case forkID != b.forkID:
		logger.WithField("new_fork", forkID).Warn("fork moved while the container ran; its changes went to a new fork")
	default:
		logger.Debug("committed snapshot changes to fork")
		return forkID, newRoot, s.publish(ctx, key, forkID, b.base, newRoot)
	}
	return forkID, newRoot, nil
}

// imageLayers are the directories of sn's image layers, top first: where a
// metadata-only copy-up of an image file (metacopy=on) finds its data at commit.
func (s *Snapshotter) imageLayers(sn storage.Snapshot) []string {
	dirs := make([]string, len(sn.ParentIDs))
	for i, p := range sn.ParentIDs {
		dirs[i] = s.upperPath(p)
	}
	return dirs
}

// advanceFork moves the bound fork from the root the snapshot started at to root, and
// returns the fork that now holds root: the bound fork, or a new fork of the base
// when the bound one moved meanwhile.
func (s *Snapshotter) advanceFork(ctx context.Context, key string, b bound, root casstore.Hash) (string, error) {
	_, err := s.forks.Advance(ctx, b.forkID, b.base, root, "commit of snapshot "+key)
	if err == nil {
		return b.forkID, nil
	}
	if !errdefs.IsFailedPrecondition(err) && !errdefs.IsNotFound(err) {
		return "", err
	}
	if f, gerr := s.forks.Get(ctx, b.forkID); gerr == nil && f.Root == root {
		return b.forkID, nil // an earlier attempt got this far
	}
	label := key + "@" + b.forkID
	f, cerr := s.forks.Create(ctx, forks.CreateRequest{Base: b.base, Label: label, Labels: map[string]string{"tidepool.dev/diverged-from": b.forkID, "tidepool.dev/snapshot": key}})
	if cerr != nil {
		return "", fmt.Errorf("fork %s moved and a fork for these changes could not be made: %w", b.forkID, cerr)
	}
	if _, err := s.forks.Advance(ctx, f.ID, b.base, root, "commit of snapshot "+key); err != nil {
		return "", err
	}
	return f.ID, nil
}

// CommitNow commits an active snapshot's changes to its fork at once, instead of when
// the snapshot is removed, and marks the snapshot so that Remove does not commit them
// again. A warm pool uses it to answer a run with the fork's new root. A snapshot
// without a bound fork commits nothing and returns an empty fork id.
func (s *Snapshotter) CommitNow(ctx context.Context, key string) (string, casstore.Hash, error) {
	s.locks.Lock(key)
	defer s.locks.Unlock(key)
	if err := s.recordPending(ctx, key); err != nil {
		return "", casstore.Hash{}, fmt.Errorf("commit %s: %w", key, err)
	}
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return "", casstore.Hash{}, fmt.Errorf("commit %s: %w", key, err)
	}
	b, ok, err := s.parseBound(info)
	if err != nil || !ok || !b.isBound() || sn.Kind != snapshots.KindActive {
		return "", casstore.Hash{}, err
	}
	if b.spec.Discard {
		return b.forkID, b.base, nil
	}
	forkID, root, err := s.commitToFork(ctx, key, sn, b)
	if err != nil {
		s.metrics.commitErrors.Inc()
		return "", root, fmt.Errorf("commit %s to fork %s: %w", key, b.forkID, err)
	}
	if err := s.setLabels(ctx, key, map[string]string{binding.LabelDiscard: "true"}); err != nil {
		return forkID, root, fmt.Errorf("commit %s: mark committed: %w", key, err)
	}
	return forkID, root, nil
}

// Cleanup removes directories of removed snapshots (asynchronous removal).
func (s *Snapshotter) Cleanup(ctx context.Context) error {
	if c, ok := s.overlay.(snapshots.Cleaner); ok {
		if err := c.Cleanup(ctx); err != nil {
			return err
		}
	}
	return s.removeOrphanViewDirs(ctx)
}

func (s *Snapshotter) removeOrphanViewDirs(ctx context.Context) error {
	var ids map[string]string
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		ids, err = storage.IDMap(ctx)
		return err
	}); err != nil {
		return err
	}
	// Slots first: an overlay on a slot may have the view as a layer.
	slots, err := os.ReadDir(filepath.Join(s.root, "slots"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, e := range slots {
		if _, live := ids[e.Name()]; live {
			continue
		}
		if err := s.unmountSlot(ctx, e.Name()); err != nil {
			log.G(ctx).WithError(err).WithField("id", e.Name()).Warn("could not remove the slot of a removed snapshot")
		}
	}
	ents, err := os.ReadDir(filepath.Join(s.root, "views"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if _, live := ids[e.Name()]; live {
			continue
		}
		dir := s.viewDir(e.Name())
		if err := s.views.Unmount(ctx, dir); err != nil {
			log.G(ctx).WithError(err).WithField("dir", dir).Warn("could not unmount orphaned view")
			continue
		}
		os.Remove(dir)
	}
	return nil
}

// detachStaleViews detaches mountpoints under views/ that no live server backs (a
// previous process died holding them), so they can be mounted again.
func (s *Snapshotter) detachStaleViews(ctx context.Context) {
	ents, err := os.ReadDir(filepath.Join(s.root, "views"))
	if err != nil {
		return
	}
	for _, e := range ents {
		dir := s.viewDir(e.Name())
		if s.views.Mounted(ctx, dir) {
			continue
		}
		if err := s.views.Unmount(ctx, dir); err != nil {
			log.G(ctx).WithError(err).WithField("dir", dir).Warn("could not detach stale view")
		}
	}
}

// Close closes the metadata store. Views stay with their host, which the owner closes.
func (s *Snapshotter) Close() error {
	s.records.running.Wait()
	s.arrivals.close()
	return s.overlay.Close()
}

// prebuild starts the views host's Prebuild of spec, as soon as the root is known, so
// that it overlaps with writing the fork record, preparing the overlay snapshot and
// pinning the root, and returns a function that waits for it. Its error is only
// logged: the Mount that follows meets the same condition and reports it (or serves
// the view another way).
func (s *Snapshotter) prebuild(ctx context.Context, spec ViewSpec) (wait func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := s.views.Prebuild(ctx, spec); err != nil {
			log.G(ctx).WithError(err).WithField("root", spec.Root.Short()).Debug("view not prebuilt")
		}
	}()
	return func() { <-done }
}

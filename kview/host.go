package kview

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Hydrator fetches objects that are not in the local store yet (a remote store). A
// kernel view can only show local objects, so the host asks it for exactly the
// objects a tree misses before it gives up on a kernel mount.
type Hydrator interface {
	Hydrate(ctx context.Context, objects []casstore.Hash) error
}

// Host mounts kernel views of one store. Its views are ordinary kernel mounts: they
// stay mounted and working when the process that made them exits, and a new Host
// finds them in the mount table (IsMounted, List).
type Host struct {
	store *casstore.Store
	cache *Cache
	stats *Stats
	// Hydrator, if set, is asked for a tree's missing objects before Mount fails with
	// a *MissingError.
	Hydrator Hydrator
	// ColdReadAhead is how many bytes of a view's files are read ahead, in the
	// background, when it is mounted onto cold caches (coldread.go); 0: none.
	ColdReadAhead int64
	cold          *coldReader
}

// NewHost returns a host whose image cache is at cacheDir.
func NewHost(store *casstore.Store, cacheDir string) (*Host, error) {
	stats := &Stats{}
	c, err := NewCache(cacheDir, store, stats)
	if err != nil {
		return nil, err
	}
	return &Host{store: store, cache: c, stats: stats, cold: newColdReader(store, stats)}, nil
}

// Close stops the host's background work (read-aheads) and waits for it. Mounted
// views stay.
func (h *Host) Close() { h.cold.close() }

// Stats returns the host's counters.
func (h *Host) Stats() *Stats { return h.stats }

// Cache returns the host's image cache.
func (h *Host) Cache() *Cache { return h.cache }

// Mount mounts the kernel view of spec at dir (an existing directory). If the tree's
// objects are not all local (and no Hydrator brings them), it fails with a
// *MissingError, which matches errdefs.ErrNotFound, and mounts nothing.
func (h *Host) Mount(ctx context.Context, dir string, spec Spec) error {
	return h.mount(ctx, dir, spec, false)
}

// MountImage mounts spec's image alone at dir (EROFS, straight from its file), for an
// overlay that layers it directly: as a lower layer with DataDir as its data-only
// layer, mounted with metacopy=on and without userxattr (the image's xattrs are
// trusted.overlay.*). Like a view it needs no process and stays mounted until
// unmounted; the mount table names its image (Mounted.Image).
func (h *Host) MountImage(ctx context.Context, dir string, spec Spec) error {
	return h.mount(ctx, dir, spec, true)
}

// DataDir is the directory an image's redirects point into: the data-only lower layer
// of an overlay that layers an image directly.
func (h *Host) DataDir() string { return h.store.Root() }

func (h *Host) mount(ctx context.Context, dir string, spec Spec, imageOnly bool) error {
	if spec.Root.IsZero() {
		return fmt.Errorf("kernel view at %s: a kernel view needs its tree at mount (no late binding): %w", dir, errdefs.ErrInvalidArgument)
	}
	dir = filepath.Clean(dir)
	// Before any image is built for it: a view is attached to a directory.
	if st, err := os.Stat(dir); err != nil {
		return fmt.Errorf("kernel view at %s: %w", dir, err)
	} else if !st.IsDir() {
		return fmt.Errorf("kernel view at %s: not a directory: %w", dir, errdefs.ErrInvalidArgument)
	}
	if IsMounted(dir) {
		return fmt.Errorf("a kernel view is already mounted at %s: %w", dir, errdefs.ErrAlreadyExists)
	}
	h.cache.gate.RLock()
	defer h.cache.gate.RUnlock()
	img, err := h.cache.image(ctx, spec)
	var miss *MissingError
	if errors.As(err, &miss) && h.Hydrator != nil {
		log.G(ctx).WithField("root", spec.Root).WithField("objects", len(miss.Objects)).Info("hydrating the objects a kernel view needs")
		if herr := h.Hydrator.Hydrate(ctx, miss.Objects); herr != nil {
			return fmt.Errorf("%w; hydrating them failed: %w", err, herr)
		}
		img, err = h.cache.image(ctx, spec)
	}
	if err != nil {
		return err
	}
	cold := prefetchImage(ctx, img)
	if imageOnly {
		err = mountImage(img, dir)
	} else {
		err = mountView(img, h.store.Root(), spec.Key(), dir)
	}
	if err != nil {
		return err
	}
	if cold && h.ColdReadAhead > 0 {
		h.cold.start(log.WithLogger(ctx, log.G(ctx).WithField("root", spec.Root.Short())), spec.Key(), h.cache.path(spec.Key(), ".objects"), h.ColdReadAhead)
	}
	log.G(ctx).WithFields(log.Fields{"dir": dir, "root": spec.Root.Short(), "image": filepath.Base(img), "image_only": imageOnly}).Debug("kernel view mounted")
	return nil
}

// Prebuild builds spec's image if it is not cached, as Mount would, without mounting
// anything: a caller that knows a view is coming (the snapshotter, once it knows the
// fork's root) starts it while it does other work (fork records, the overlay
// snapshot), and the Mount that follows finds the image built or waits for this
// build (single-flight); a warm pool builds a fork's next root the same way so that
// its next claim finds it. A tree with objects missing fails with a *MissingError;
// Prebuild does not hydrate them (Mount does).
func (h *Host) Prebuild(ctx context.Context, spec Spec) error {
	if spec.Root.IsZero() {
		return fmt.Errorf("kernel view image: no tree: %w", errdefs.ErrInvalidArgument)
	}
	h.cache.gate.RLock()
	defer h.cache.gate.RUnlock()
	_, err := h.cache.image(ctx, spec)
	return err
}

// WarmTrees decodes the trees of the roots of the most recently used images into
// the memo that builds share (see Cache.WarmTrees); a process calls it once, when it
// starts.
func (h *Host) WarmTrees(ctx context.Context, roots int) (int, error) {
	return h.cache.WarmTrees(ctx, roots)
}

// Unmount detaches the kernel view at dir; a dir without one is fine.
func (h *Host) Unmount(_ context.Context, dir string) error { return unmountView(dir) }

// Mounted reports whether a kernel view is mounted at dir.
func (h *Host) Mounted(dir string) bool { return IsMounted(dir) }

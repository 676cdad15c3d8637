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

	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/internal/mountapi"
)

// Slots: how a warm pool member gets a kernel view at claim.
//
// A kernel view shows its tree from the moment it is mounted, so it cannot sit,
// empty, in a member's rootfs and take its fork later as a FUSE view does. A
// snapshot prepared with binding.LabelSlot therefore has no view in its rootfs
// at all (its mounts are the overlay snapshotter's) but a slot: ROOT/slots/<id>,
// bind-mounted onto itself and made shared in a peer group of its own. The
// container binds the slot at its workdir with rslave propagation (the pool puts
// that mount in the member's spec), so whatever is later mounted onto the slot on
// the host appears at the workdir inside the container, running or frozen, and
// nothing mounted inside the container leaks out.
//
// Bind mounts the fork onto the slot: the view (a kernel view's image alone, or
// its nested overlay; FUSE when the tree is not all local and views.mode allows
// it) at views/<id>, with the tree at its root (no prefix), and over it a
// writable overlay whose layers are the view, then the image layers' own content
// at the workdir (so that, as in a rootfs with the view in it, node_modules baked
// under the workdir shows through), and, for an image, the object store as
// data-only layer; its upper and work directories are snapshots/<id>/slot-fs and
// slot-work. That overlay has the container overlay's shape restricted to the
// workdir, so the commit is the same walk over slot-fs with no prefix (changes).
// The slot is the overlay's root, so slot-fs starts with the view root's owner
// and mode: the overlay takes its root's attributes from its upper directory.
//
// The mounts are kernel mounts: they outlive tidepoold, and the commit after a
// restart reads slot-fs as before. Remove unmounts the overlay and the slot
// (unmountSlot) after the commit.

func (s *Snapshotter) slotDir(id string) string { return filepath.Join(s.root, "slots", id) }
func (s *Snapshotter) slotUpper(id string) string {
	return filepath.Join(s.root, "snapshots", id, "slot-fs")
}
func (s *Snapshotter) slotWork(id string) string {
	return filepath.Join(s.root, "snapshots", id, "slot-work")
}

// SlotDir is the slot of a snapshot prepared with binding.LabelSlot: the host
// directory its container must bind at the workdir, with rslave propagation.
func (s *Snapshotter) SlotDir(ctx context.Context, key string) (string, error) {
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return "", fmt.Errorf("slot of %s: %w", key, err)
	}
	b, ok, err := s.parseBound(info)
	if err != nil {
		return "", fmt.Errorf("slot of %s: %w", key, err)
	}
	if !ok || !b.spec.Slot {
		return "", fmt.Errorf("snapshot %s was not prepared with %s: %w", key, binding.LabelSlot, errdefs.ErrFailedPrecondition)
	}
	return s.slotDir(sn.ID), nil
}

// ensureSlot makes the slot of snapshot id unless it is there (a slot outlives
// tidepoold): its directory bind-mounted onto itself, made private (no peer of the
// mount it lives in, whose propagation the host decides) and then shared, in a peer
// group of its own.
func (s *Snapshotter) ensureSlot(id string) error {
	dir := s.slotDir(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create slot: %w", err)
	}
	if mounted, err := mountinfo.Mounted(dir); err != nil {
		return fmt.Errorf("slot %s: %w", dir, err)
	} else if mounted {
		return nil
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("slot %s: bind: %w", dir, err)
	}
	for _, flag := range []uintptr{unix.MS_PRIVATE, unix.MS_SHARED} {
		if err := unix.Mount("", dir, "", flag, ""); err != nil {
			unix.Unmount(dir, unix.MNT_DETACH)
			return fmt.Errorf("slot %s: propagation: %w", dir, err)
		}
	}
	return nil
}

// slotBound reports whether a view is mounted onto snapshot id's slot, and whether
// the slot is there at all.
func (s *Snapshotter) slotBound(id string) (bound, present bool, err error) {
	dir := s.slotDir(id)
	ms, err := mountapi.Stack(dir)
	if err != nil || len(ms) == 0 {
		return false, false, err
	}
	return len(ms) > 1, true, nil
}

// unmountSlot unmounts whatever is mounted onto snapshot id's slot and the slot
// itself, and removes its directory. The container that bound it is gone by then
// (its snapshot is being removed); a mount still busy is detached.
func (s *Snapshotter) unmountSlot(ctx context.Context, id string) error {
	dir := s.slotDir(id)
	for range 8 {
		mounted, err := mountinfo.Mounted(dir)
		if errors.Is(err, fs.ErrNotExist) || err == nil && !mounted {
			break
		}
		if err != nil {
			return fmt.Errorf("slot %s: %w", dir, err)
		}
		err = unix.Unmount(dir, unix.UMOUNT_NOFOLLOW)
		if errors.Is(err, unix.EBUSY) {
			log.G(ctx).WithField("slot", dir).Warn("slot still busy at removal; detaching it")
			err = unix.Unmount(dir, unix.UMOUNT_NOFOLLOW|unix.MNT_DETACH)
		}
		if err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmount slot %s: %w", dir, err)
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove slot %s: %w", dir, err)
	}
	return nil
}

// bindSlot binds a fork to a snapshot prepared with a slot: the fork's view is
// mounted, writable, onto the slot, and so appears at the workdir of the container
// that binds it. Like bindLate it takes over key's lock (*unlock) and records the
// binding behind the claim.
func (s *Snapshotter) bindSlot(ctx context.Context, key string, sn storage.Snapshot, have bound, want binding.Spec, unlock *func()) (_ BindResult, retErr error) {
	forkID, root, hold, undo, err := s.forkToBind(ctx, key, want)
	if err != nil {
		return BindResult{}, err
	}
	defer func() {
		if retErr != nil {
			undo()
		}
	}()
	if err := s.mountSlot(ctx, sn, have.spec, root); err != nil {
		hold()
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	mounts, err := s.overlay.Mounts(ctx, key)
	if err != nil {
		hold()
		s.unmountSlotView(ctx, sn.ID)
		return BindResult{}, fmt.Errorf("bind %s: %w", key, err)
	}
	s.recordBind(ctx, key, forkID, root, want, hold, unlock, "slot")
	return BindResult{Key: key, ForkID: forkID, Root: root, Mounts: mounts}, nil
}

// PrebuildSlotView prepares the view a slot bind of root for owner ("uid:gid")
// would mount (a kernel view's image), so that the bind finds it ready: a warm pool
// asks for it for the root a claim just committed, which the fork's next claim shows.
func (s *Snapshotter) PrebuildSlotView(ctx context.Context, root casstore.Hash, owner string) error {
	uid, gid, err := binding.ParseOwner(owner)
	if err != nil {
		return fmt.Errorf("prebuild view of %s: owner %q: %w", root.Short(), owner, err)
	}
	return s.views.Prebuild(ctx, ViewSpec{Root: root, UID: uid, GID: gid, Image: s.direct})
}

// unmountSlotView undoes a mountSlot whose bind failed later: the overlay on the
// slot (the slot itself stays) and the view.
func (s *Snapshotter) unmountSlotView(ctx context.Context, id string) {
	ctx = context.WithoutCancel(ctx)
	if bound, _, _ := s.slotBound(id); bound {
		if err := unix.Unmount(s.slotDir(id), unix.UMOUNT_NOFOLLOW|unix.MNT_DETACH); err != nil {
			log.G(ctx).WithError(err).WithField("slot", s.slotDir(id)).Warn("could not unmount the view of a failed bind from its slot")
		}
	}
	if err := s.views.Unmount(ctx, s.viewDir(id)); err != nil {
		log.G(ctx).WithError(err).Warn("could not unmount the view of a failed bind")
	}
}

// mountSlot mounts root's view at views/<id> and the writable overlay over it onto
// the slot.
func (s *Snapshotter) mountSlot(ctx context.Context, sn storage.Snapshot, spec binding.Spec, root casstore.Hash) (retErr error) {
	// The slot takes one overlay, once: its upper directory exists from then on.
	if _, err := os.Lstat(s.slotUpper(sn.ID)); err == nil {
		return fmt.Errorf("the slot of snapshot %s was filled before: %w", sn.ID, errdefs.ErrFailedPrecondition)
	}
	start := time.Now()
	view := s.viewDir(sn.ID)
	if err := os.MkdirAll(view, 0o700); err != nil {
		return fmt.Errorf("create view mountpoint: %w", err)
	}
	if !s.views.Mounted(ctx, view) {
		if err := s.views.Mount(ctx, view, ViewSpec{Root: root, UID: spec.UID, GID: spec.GID, Image: s.direct}); err != nil {
			return fmt.Errorf("mount fork view at %s: %w", view, err)
		}
	}
	defer func() {
		if retErr != nil {
			s.unmountSlotView(ctx, sn.ID)
			os.RemoveAll(s.slotUpper(sn.ID))
			os.RemoveAll(s.slotWork(sn.ID))
		}
	}()
	data, image, err := s.views.ImageLayer(view)
	if err != nil {
		return fmt.Errorf("fork view at %s: %w", view, err)
	}
	viewTime := time.Since(start)
	if err := s.mountSlotOverlay(sn, spec, view, data, image); err != nil {
		return err
	}
	log.G(ctx).WithFields(log.Fields{"id": sn.ID, "root": root.Short(), "image": image, "view": viewTime, "total": time.Since(start)}).Debug("fork view mounted onto its slot")
	return nil
}

// mountSlotOverlay mounts the slot's writable overlay: top (the view; or an empty
// directory, for no fork) over the image layers' content at the workdir, with
// data as data-only layer when top is a kernel view's image.
func (s *Snapshotter) mountSlotOverlay(sn storage.Snapshot, spec binding.Spec, top, data string, image bool) error {
	layers, err := s.slotLayers(sn, spec.Prefix())
	if err != nil {
		return err
	}
	upper, work := s.slotUpper(sn.ID), s.slotWork(sn.ID)
	for _, d := range []string{upper, work} {
		if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("slot upper: %w", err)
		}
	}
	// The overlay's root is the workdir, and an overlay's root has its upper
	// directory's owner and mode: the view root's.
	if err := os.Chown(upper, int(spec.UID), int(spec.GID)); err != nil {
		return fmt.Errorf("slot upper: %w", err)
	}
	if err := os.Chmod(upper, 0o755); err != nil {
		return fmt.Errorf("slot upper: %w", err)
	}
	params := [][2]string{{"source", "tidepool-slot"}}
	for _, l := range append([]string{top}, layers...) {
		params = append(params, [2]string{"lowerdir+", l})
	}
	if image {
		params = append(params, [2]string{"datadir+", data}, [2]string{"metacopy", "on"}, [2]string{"redirect_dir", "on"})
	}
	params = append(params, [2]string{"upperdir", upper}, [2]string{"workdir", work})
	for _, o := range s.options {
		k, v, _ := strings.Cut(o, "=")
		params = append(params, [2]string{k, v})
	}
	return mountOverlayAt(params, s.slotDir(sn.ID))
}

// OpenSlot gives a slot snapshot's container what its rootfs would show at the
// workdir had it no fork: the image layers' content there, writable, onto the slot
// (a claim that names no fork). Nothing is committed.
func (s *Snapshotter) OpenSlot(ctx context.Context, key string) error {
	s.locks.Lock(key)
	defer s.locks.Unlock(key)
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return fmt.Errorf("open slot of %s: %w", key, err)
	}
	b, ok, err := s.parseBound(info)
	switch {
	case err != nil:
		return fmt.Errorf("open slot of %s: %w", key, err)
	case !ok || !b.spec.Slot:
		return fmt.Errorf("snapshot %s was not prepared with %s: %w", key, binding.LabelSlot, errdefs.ErrFailedPrecondition)
	case b.isBound():
		return fmt.Errorf("snapshot %s is bound to fork %s: %w", key, b.forkID, errdefs.ErrFailedPrecondition)
	}
	if _, err := os.Lstat(s.slotUpper(sn.ID)); err == nil {
		return fmt.Errorf("the slot of snapshot %s was filled before: %w", key, errdefs.ErrFailedPrecondition)
	}
	// The top layer: an empty directory (an overlay needs a lower layer).
	empty := s.viewDir(sn.ID)
	if err := os.MkdirAll(empty, 0o700); err != nil {
		return fmt.Errorf("open slot of %s: %w", key, err)
	}
	if err := s.mountSlotOverlay(sn, b.spec, empty, "", false); err != nil {
		os.RemoveAll(s.slotUpper(sn.ID))
		os.RemoveAll(s.slotWork(sn.ID))
		return fmt.Errorf("open slot of %s: %w", key, err)
	}
	return nil
}

// mountOverlayAt mounts an overlay with params (key, value; a flag has no value)
// at dir with the new mount API: each layer is a parameter of its own, so no
// option string bounds their number.
func mountOverlayAt(params [][2]string, dir string) error {
	mfd, err := mountapi.Detached("overlay", params, nil, 0)
	if err != nil {
		return fmt.Errorf("overlay for %s: %w", dir, err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach overlay at %s: %w", dir, err)
	}
	return nil
}

// slotLayers are the image layers' directories at the workdir (prefix) that the
// container's rootfs shows there, top first: a layer holds one if it has a
// directory at prefix; a whiteout or a non-directory at prefix or above it hides
// that layer's and every lower layer's, and an opaque directory at prefix or above
// hides the lower layers'. They are lower layers of the slot's overlay, and the
// commit's Lowers (where a metadata-only copy-up of one of their files finds its
// data).
func (s *Snapshotter) slotLayers(sn storage.Snapshot, prefix string) ([]string, error) {
	comps := strings.Split(prefix, "/")
	var out []string
	for _, layer := range s.imageLayers(sn) {
		p, present, opaque := layer, true, false
		for _, c := range comps {
			p = filepath.Join(p, c)
			info, err := os.Lstat(p)
			if errors.Is(err, fs.ErrNotExist) {
				present = false
				break
			}
			if err != nil {
				return nil, fmt.Errorf("image layer %s: %w", layer, err)
			}
			if !info.IsDir() {
				return out, nil // a whiteout or a file: nothing below shows
			}
			if s.opaque(p) {
				opaque = true
			}
		}
		if present {
			out = append(out, p)
		}
		if opaque {
			break
		}
	}
	return out, nil
}

// opaque reports whether the directory p of an image layer is opaque, in the
// xattr namespace the overlay snapshotter writes its layers with.
func (s *Snapshotter) opaque(p string) bool {
	name := "trusted.overlay.opaque"
	if hasOption(s.options, "userxattr") {
		name = "user.overlay.opaque"
	}
	buf := make([]byte, 8)
	n, err := unix.Lgetxattr(p, name, buf)
	return err == nil && n == 1 && buf[0] == 'y'
}

// changes says where a bound snapshot's changes under its workdir are: the upper
// directory, the workdir's path in it, and the image layers a metadata-only
// copy-up of an image file takes its data from.
func (s *Snapshotter) changes(sn storage.Snapshot, b bound) (upper, prefix string, lowers []string, err error) {
	if b.spec.Slot {
		lowers, err := s.slotLayers(sn, b.spec.Prefix())
		return s.slotUpper(sn.ID), "", lowers, err
	}
	return s.upperPath(sn.ID), b.spec.Prefix(), s.imageLayers(sn), nil
}

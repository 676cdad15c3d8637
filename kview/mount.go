package kview

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/internal/mountapi"
)

// SourcePrefix starts the source of every kernel view's overlay mount; the image key
// follows it. It is how views are found in the mount table after a restart.
const SourcePrefix = "tidepool-kview:"

// Mounted is a kernel view found in the mount table.
type Mounted struct {
	Dir string // mountpoint
	Key string // image key
	// Image: the image alone (MountImage), to be layered directly into a container's
	// overlay with the object directory as data-only layer; otherwise the view's own
	// overlay.
	Image bool
}

// mountImage mounts image alone at dir: EROFS, straight from its file (never a loop
// device), read-only, nodev and nosuid. Its source in the mount table is the image's
// path, which names its key.
func mountImage(image, dir string) error {
	fd, err := mountErofs(image)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach image %s at %s: %w", image, dir, err)
	}
	return nil
}

// mountErofs returns a detached EROFS mount of image.
func mountErofs(image string) (int, error) {
	fd, err := fsmount("erofs", map[string]string{"source": image}, nil)
	if err != nil {
		switch {
		case errors.Is(err, unix.ENODEV):
			err = fmt.Errorf("%w (EROFS is not in this kernel: CONFIG_EROFS_FS)", err)
		case errors.Is(err, unix.ENOTBLK), errors.Is(err, unix.EINVAL):
			err = fmt.Errorf("%w (EROFS cannot mount an image file: needs kernel >= 6.12 with CONFIG_EROFS_FS_BACKED_BY_FILE, and the image on a filesystem that can back it: ext4, xfs or btrfs, not tmpfs or overlayfs)", err)
		}
		return -1, fmt.Errorf("mount image %s: %w", image, err)
	}
	return fd, nil
}

// mountView mounts the view of image at dir: the image, mounted by EROFS straight from
// its file (kernel >= 6.12) and never attached anywhere, is the overlay's lower layer,
// and objects (the store root) its data-only lower layer, which the image's redirect
// xattrs point into. Both mounts are read-only, nodev and nosuid.
func mountView(image, objects, key, dir string) error {
	erofsFD, err := mountErofs(image)
	if err != nil {
		return err
	}
	defer unix.Close(erofsFD)
	ovlFD, err := fsmount("overlay", map[string]string{"source": SourcePrefix + key, "metacopy": "on", "redirect_dir": "follow"},
		func(fd int) error {
			if err := unix.FsconfigSetFd(fd, "lowerdir+", erofsFD); err != nil {
				return fmt.Errorf("lowerdir+: %w", err)
			}
			if err := unix.FsconfigSetString(fd, "datadir+", objects); err != nil {
				return fmt.Errorf("datadir+ %s: %w", objects, err)
			}
			return nil
		})
	if err != nil {
		switch {
		case errors.Is(err, unix.ENODEV):
			err = fmt.Errorf("%w (overlayfs is not in this kernel)", err)
		case errors.Is(err, unix.EINVAL):
			err = fmt.Errorf("%w (overlayfs data-only lower layers need kernel >= 6.5, layers given by fd >= 6.13)", err)
		}
		return fmt.Errorf("mount overlay of image %s over %s: %w", image, objects, err)
	}
	defer unix.Close(ovlFD)
	if err := unix.MoveMount(ovlFD, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach view at %s: %w", dir, err)
	}
	return nil
}

// fsmount creates a detached, read-only mount of fstype with the new mount API:
// string parameters first (in a fixed order), then whatever more sets, and returns
// the mount's fd. Failures carry the kernel's own message from the context log.
func fsmount(fstype string, params map[string]string, more func(fd int) error) (int, error) {
	var ordered [][2]string
	for _, k := range []string{"source", "metacopy", "redirect_dir"} {
		if v, ok := params[k]; ok {
			ordered = append(ordered, [2]string{k, v})
		}
	}
	return mountapi.Detached(fstype, ordered, more, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOSUID)
}

// unmountView detaches the view at dir. A dir with no kernel view mounted is fine.
// Containers whose overlay uses the view as a layer keep working: overlayfs holds
// its own private clone of each layer.
func unmountView(dir string) error {
	m, err := mountedAt(dir)
	if err != nil {
		return err
	}
	if m == nil {
		return nil
	}
	if err := unix.Unmount(dir, unix.UMOUNT_NOFOLLOW); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("unmount kernel view %s: %w: %w", dir, err, errdefs.ErrFailedPrecondition)
		}
		return fmt.Errorf("unmount kernel view %s: %w", dir, err)
	}
	return nil
}

// mountedAt returns the kernel view mounted at dir, or nil. Only the topmost mount at
// dir counts.
func mountedAt(dir string) (*Mounted, error) {
	ms, err := mountapi.Stack(dir)
	if err != nil {
		return nil, err
	}
	if len(ms) == 0 {
		return nil, nil
	}
	return asView(ms[len(ms)-1]), nil
}

// asView recognizes a view's mount: an overlay whose source names its key, or an
// EROFS mount of a cached image (its source is the image's path, KEY.erofs).
func asView(m *mountinfo.Info) *Mounted {
	switch m.FSType {
	case "overlay":
		if key, ok := strings.CutPrefix(m.Source, SourcePrefix); ok {
			return &Mounted{Dir: m.Mountpoint, Key: key}
		}
	case "erofs":
		if key, ok := strings.CutSuffix(filepath.Base(m.Source), ".erofs"); ok && validKey(key) {
			return &Mounted{Dir: m.Mountpoint, Key: key, Image: true}
		}
	}
	return nil
}

// validKey reports whether s looks like Spec.Key's output.
func validKey(s string) bool {
	if len(s) != 32 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// List returns the kernel views mounted at or under dir.
func List(dir string) ([]Mounted, error) {
	dir, err := mountapi.Mountpoint(dir)
	if err != nil {
		return nil, err
	}
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	var out []Mounted
	for _, m := range ms {
		if v := asView(m); v != nil {
			out = append(out, *v)
		}
	}
	return out, nil
}

// IsMounted reports whether a kernel view is mounted at dir.
func IsMounted(dir string) bool {
	m, err := mountedAt(dir)
	return err == nil && m != nil
}

// MountedAt returns the kernel view mounted at dir, or nil.
func MountedAt(dir string) (*Mounted, error) { return mountedAt(dir) }

// ensureDir makes dir (mode 0700) if it is missing.
func ensureDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	return nil
}

// UnmountDir detaches the kernel view at dir; a dir without one is fine. Containers
// whose overlay uses the view as a layer keep working.
func UnmountDir(dir string) error { return unmountView(dir) }

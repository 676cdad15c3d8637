package fuse

import (
	"errors"
	"fmt"
	"sort"

	"github.com/containerd/errdefs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/internal/mountapi"
)

// mounts reads the mount table (github.com/moby/sys/mountinfo parses it,
// unescaping mountpoints) keeping the entries filter accepts, in table order.
func mounts(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	all, err := mountinfo.GetMounts(filter)
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	return all, nil
}

// Mounts lists the views mounted at or below under (fstype fuse.tidepool), sorted so
// that a mount comes after any mount below it: unmounting in order never meets a
// busy parent. A daemon calls it at start to clean up after a crash.
func Mounts(under string) ([]string, error) {
	base, err := mountapi.Mountpoint(under)
	if err != nil {
		return nil, fmt.Errorf("list views under %s: %w", under, err)
	}
	var prefix mountinfo.FilterFunc // nil: everything is below "/"
	if base != "/" {
		prefix = mountinfo.PrefixFilter(base)
	}
	all, err := mounts(prefix)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var out []string
	for _, m := range all {
		if m.FSType != FsType || seen[m.Mountpoint] {
			continue
		}
		seen[m.Mountpoint] = true
		out = append(out, m.Mountpoint)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] > out[j] })
	return out, nil
}

// topMount returns the fstype of the topmost mount at point, or "" if none.
func topMount(point string) (string, error) {
	all, err := mountapi.Stack(point)
	if err != nil || len(all) == 0 {
		return "", err
	}
	return all[len(all)-1].FSType, nil
}

// UnmountStale detaches the view mounted at dir lazily (MNT_DETACH), so that a
// mountpoint whose server died (every access fails with ENOTCONN) or that a crashed
// daemon left behind can be reused at once. Every view stacked at dir goes. A dir
// with no mount is fine; a dir where something other than a view is mounted is an
// error and is left alone.
func UnmountStale(dir string) error {
	return unmountOurs(dir, unix.MNT_DETACH)
}

// UnmountDir unmounts the view at dir (served by any process), without detaching: it
// fails with an error wrapping errdefs.ErrFailedPrecondition while the view is busy
// and with errdefs.ErrNotFound if no view is mounted there. The serving process
// notices and exits.
func UnmountDir(dir string) error {
	p, err := mountapi.Mountpoint(dir)
	if err != nil {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	top, err := topMount(p)
	if err != nil {
		return err
	}
	if top != FsType {
		return fmt.Errorf("unmount %s: no tidepool view is mounted there: %w", p, errdefs.ErrNotFound)
	}
	return unmountOurs(p, 0)
}

func unmountOurs(dir string, flags int) error {
	p, err := mountapi.Mountpoint(dir)
	if err != nil {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	// Views can be stacked at one point; each pass removes the topmost. The bound
	// guards against a table that does not change (which would be a kernel oddity).
	for range 64 {
		top, err := topMount(p)
		if err != nil {
			return err
		}
		switch top {
		case "":
			return nil
		case FsType:
		default:
			return fmt.Errorf("unmount %s: %s is mounted there, not a tidepool view: %w", p, top, errdefs.ErrFailedPrecondition)
		}
		err = unix.Unmount(p, flags)
		switch {
		case err == nil, errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			// Done, or unmounted meanwhile: look again.
		case errors.Is(err, unix.EBUSY):
			return fmt.Errorf("unmount %s: %w: %w", p, err, errdefs.ErrFailedPrecondition)
		default:
			return fmt.Errorf("unmount %s: %w", p, err)
		}
	}
	return fmt.Errorf("unmount %s: views are still mounted there", p)
}

package mountapi

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"github.com/moby/sys/mountinfo"
)

// Mountpoint is dir as the kernel's mount table names it: absolute, with every
// symbolic link in its parent resolved. The table shows real paths, so a directory
// reached through a link (a relative path from a shell, a root under a /var/lib that
// links to a data disk) matches none of its entries as given. dir itself is not
// resolved: it may be a dead FUSE mount that cannot be stat'ed (ENOTCONN), and a
// mountpoint is never a link. A parent that does not exist leaves the path as it is
// (nothing can be mounted under it).
func Mountpoint(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if abs == "/" {
		return abs, nil
	}
	parent, err := filepath.EvalSymlinks(filepath.Dir(abs))
	if errors.Is(err, fs.ErrNotExist) {
		return abs, nil
	}
	if err != nil {
		return "", fmt.Errorf("resolve %s: %w", dir, err)
	}
	return filepath.Join(parent, filepath.Base(abs)), nil
}

// Stack returns every mount at dir (resolved by Mountpoint), lowest first: the last
// is the one a path walk of dir finds. mountinfo.SingleEntryFilter would stop at the
// lowest, which is not what is there once something is mounted over it (a view over
// a pool member's slot, a mount over a kernel view).
func Stack(dir string) ([]*mountinfo.Info, error) {
	p, err := Mountpoint(dir)
	if err != nil {
		return nil, err
	}
	ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) { return m.Mountpoint != p, false })
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	return ms, nil
}

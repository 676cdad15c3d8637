package hostcheck

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// scratch is a private tmpfs for a probe's directories: tmpfs takes trusted.*
// xattrs, is always an acceptable overlay layer, and leaves nothing on the host's
// disks.
type scratch struct {
	dir    string
	mounts []string // unmounted in reverse order by close
}

var errNotRoot = errors.New("needs root (CAP_SYS_ADMIN) to mount")

func newScratch() (*scratch, error) {
	if os.Geteuid() != 0 {
		return nil, errNotRoot
	}
	dir, err := os.MkdirTemp("", "tidepool-hostcheck-")
	if err != nil {
		return nil, err
	}
	s := &scratch{dir: dir}
	if err := s.mount("tidepool-hostcheck", dir, "tmpfs", 0, "mode=0700,size=1m"); err != nil {
		os.Remove(dir)
		return nil, err
	}
	return s, nil
}

func (s *scratch) mount(source, target, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		if data == "" {
			return fmt.Errorf("mount -t %s %s: %w", fstype, source, err)
		}
		return fmt.Errorf("mount -t %s -o %s %s: %w", fstype, data, source, err)
	}
	s.mounts = append(s.mounts, target)
	return nil
}

func (s *scratch) path(elem string) string { return s.dir + "/" + elem }

func (s *scratch) mkdirs(names ...string) error {
	for _, n := range names {
		if err := os.Mkdir(s.path(n), 0o700); err != nil {
			return err
		}
	}
	return nil
}

func (s *scratch) close() {
	for i := len(s.mounts) - 1; i >= 0; i-- {
		if err := unix.Unmount(s.mounts[i], 0); err != nil {
			unix.Unmount(s.mounts[i], unix.MNT_DETACH)
		}
	}
	os.Remove(s.dir)
}

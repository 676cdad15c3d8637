// Package mountapi makes mounts with the kernel's new mount API (fsopen, fsconfig,
// fsmount): each parameter is set on its own, so no option string bounds how many
// layers an overlay takes, a layer can be given as a file descriptor, and a failure
// carries the kernel's own message from the filesystem context's log instead of a
// bare EINVAL. Kernel views (kview) and a warm pool member's slot (snapshotter) both
// mount this way; they and the FUSE views read what is stacked at their directories
// with Stack.
package mountapi

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// Detached creates a mount of fstype that is attached nowhere and returns its fd
// (close it when done; unix.MoveMount attaches it). params are set in order (a
// parameter with an empty value is a flag), then more, if given, sets what needs the
// context's fd (a layer given by fd); attrs are MOUNT_ATTR_* flags of the mount.
func Detached(fstype string, params [][2]string, more func(fd int) error, attrs int) (int, error) {
	fd, err := unix.Fsopen(fstype, unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen %s: %w", fstype, err)
	}
	defer unix.Close(fd)
	for _, p := range params {
		if p[1] == "" {
			err = unix.FsconfigSetFlag(fd, p[0])
		} else {
			err = unix.FsconfigSetString(fd, p[0], p[1])
		}
		if err != nil {
			return -1, fmt.Errorf("%s %s=%s: %w%s", fstype, p[0], p[1], err, KernelLog(fd))
		}
	}
	if more != nil {
		if err := more(fd); err != nil {
			return -1, fmt.Errorf("%s: %w%s", fstype, err, KernelLog(fd))
		}
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return -1, fmt.Errorf("create %s: %w%s", fstype, err, KernelLog(fd))
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, attrs)
	if err != nil {
		return -1, fmt.Errorf("fsmount %s: %w%s", fstype, err, KernelLog(fd))
	}
	return mfd, nil
}

// KernelLog reads the messages the kernel left in a filesystem context, as
// " (kernel: ...)", or "" if there are none.
func KernelLog(fd int) string {
	var msgs []string
	buf := make([]byte, 1024)
	for range 16 {
		n, err := unix.Read(fd, buf)
		if err != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	if len(msgs) == 0 {
		return ""
	}
	return " (kernel: " + strings.Join(msgs, "; ") + ")"
}

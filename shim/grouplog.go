package shim

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// A shim's log reaches containerd through a FIFO in the bundle of the container that
// started it ("log"; containerd reads it for as long as that container's shim
// connection lives and copies it into its own log). runc's grouped shims live no
// longer than their pod's sandbox container, whose bundle that is. A tidepool group's
// shim outlives the member that started it: once that member is deleted, containerd
// stops reading its FIFO and everything the shim logs after (errors, SIGUSR1's
// goroutine dump) is lost. So when the member whose FIFO the shim writes to is
// deleted, the shim moves its stderr to the FIFO of another member it serves; each
// member's start opened one, and containerd reads it while the member exists.

// shimLogFIFO is the FIFO containerd reads a shim's log from, in a bundle.
const shimLogFIFO = "log"

// logBundleLocked is the bundle whose log FIFO the shim's stderr is, learnt on first
// use: the shim's working directory is the bundle of the container that started it.
func (s *TaskService) logBundleLocked() string {
	if s.logBundle == "" {
		s.logBundle, _ = os.Getwd()
	}
	return s.logBundle
}

// moveLogLocked points the shim's stderr at the log FIFO of one of the containers it
// still serves once deleted (the container with that bundle is gone). With no
// container left, the log stays where it is until the next one leaves a FIFO to use.
func (s *TaskService) moveLogLocked(deleted string) {
	if s.group == nil || filepath.Clean(deleted) != filepath.Clean(s.logBundleLocked()) {
		return
	}
	for _, b := range s.bundles {
		if err := redirectStderr(filepath.Join(b, shimLogFIFO)); err == nil {
			s.logBundle = b
			return
		}
	}
}

// redirectStderr makes fifo the process's stderr and the logger's output. It opens without blocking, so a
// FIFO nobody reads any more is refused (ENXIO) instead of waiting for a reader.
func redirectStderr(fifo string) error {
	fd, err := unix.Open(fifo, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open shim log %s: %w", fifo, err)
	}
	defer unix.Close(fd)
	if err := unix.SetNonblock(fd, false); err != nil {
		return fmt.Errorf("shim log %s: %w", fifo, err)
	}
	if err := unix.Dup3(fd, 2, 0); err != nil {
		return fmt.Errorf("shim log %s onto stderr: %w", fifo, err)
	}
	// The shim library's logger writes to its own descriptor of the first FIFO, not
	// to stderr: from now on it writes to stderr.
	log.L.Logger.SetOutput(os.Stderr)
	return nil
}

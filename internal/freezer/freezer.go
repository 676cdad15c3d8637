// Package freezer stops and resumes a process's cgroup (v1 freezer) for a bounded
// time. It exists because branching a running container must freeze it only for
// the few milliseconds a walk of its changes takes: containerd's task Pause runs the
// OCI runtime binary twice (pause, resume), which costs more than the walk itself,
// and containerd's cgroup library waits for a state change without a deadline (a
// task stuck in an uninterruptible sleep would hang the caller, container frozen).
package freezer

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/moby/sys/mountinfo"
)

// Freezer states as the kernel spells them in freezer.state.
const (
	Thawed   = "THAWED"
	Freezing = "FREEZING"
	Frozen   = "FROZEN"
)

// ErrNoFreezer says the process is not in a v1 freezer cgroup of its own (a cgroup
// v2 host, no freezer hierarchy, or the root cgroup): the caller pauses another way.
var ErrNoFreezer = fmt.Errorf("no cgroup v1 freezer for the process: %w", errdefs.ErrNotImplemented)

var (
	rootOnce sync.Once
	root     string
	rootErr  error
)

// hierarchy is where the v1 freezer hierarchy is mounted.
func hierarchy() (string, error) {
	rootOnce.Do(func() {
		ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) {
			if m.FSType != "cgroup" {
				return true, false
			}
			for _, o := range strings.Split(m.VFSOptions, ",") {
				if o == "freezer" {
					return false, true
				}
			}
			return true, false
		})
		switch {
		case err != nil:
			rootErr = err
		case len(ms) == 0:
			rootErr = ErrNoFreezer
		default:
			root = ms[0].Mountpoint
		}
	})
	return root, rootErr
}

// Cgroup is one freezer cgroup, by its directory in the hierarchy.
type Cgroup struct{ dir string }

// Of returns the freezer cgroup process pid is in. The root cgroup is refused:
// freezing it would freeze the host.
func Of(pid int) (Cgroup, error) {
	h, err := hierarchy()
	if err != nil {
		return Cgroup{}, err
	}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return Cgroup{}, fmt.Errorf("cgroups of pid %d: %w", pid, err)
	}
	for _, line := range bytes.Split(data, []byte("\n")) {
		parts := strings.SplitN(string(line), ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c != "freezer" {
				continue
			}
			p := filepath.Clean("/" + parts[2])
			if p == "/" {
				return Cgroup{}, fmt.Errorf("pid %d is in the root freezer cgroup: %w", pid, ErrNoFreezer)
			}
			return Cgroup{dir: filepath.Join(h, p)}, nil
		}
	}
	return Cgroup{}, fmt.Errorf("pid %d: %w", pid, ErrNoFreezer)
}

// Path is the cgroup's directory.
func (c Cgroup) Path() string { return c.dir }

// State reads the cgroup's freezer state.
func (c Cgroup) State() (string, error) {
	b, err := os.ReadFile(filepath.Join(c.dir, "freezer.state"))
	if err != nil {
		return "", fmt.Errorf("freezer %s: %w", c.dir, err)
	}
	return strings.TrimSpace(string(b)), nil
}

func (c Cgroup) set(state string) error {
	if err := os.WriteFile(filepath.Join(c.dir, "freezer.state"), []byte(state), 0); err != nil {
		return fmt.Errorf("freezer %s: set %s: %w", c.dir, state, err)
	}
	return nil
}

// wait sets state and polls until the kernel reports it, or until the deadline.
func (c Cgroup) wait(state string, deadline time.Time) error {
	sleep := 50 * time.Microsecond
	for {
		// Writing again is what the kernel's own freezer users do: tasks that
		// forked meanwhile are caught on the next write.
		if err := c.set(state); err != nil {
			return err
		}
		got, err := c.State()
		if err != nil {
			return err
		}
		if got == state {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("freezer %s: still %s after waiting for %s: %w", c.dir, got, state, errdefs.ErrUnavailable)
		}
		time.Sleep(sleep)
		if sleep < time.Millisecond {
			sleep *= 2
		}
	}
}

// Freeze freezes the cgroup, waiting at most timeout for every task in it to stop,
// and returns the function that thaws it. A cgroup that is not thawed (someone paused
// the container) is refused, so a thaw never resumes what another caller froze. On
// timeout the cgroup is thawed again and the error wraps errdefs.ErrUnavailable.
func (c Cgroup) Freeze(timeout time.Duration) (thaw func() error, err error) {
	st, err := c.State()
	if err != nil {
		return nil, err
	}
	if st != Thawed {
		return nil, fmt.Errorf("freezer %s is %s (paused by someone else?): %w", c.dir, st, errdefs.ErrFailedPrecondition)
	}
	if err := c.wait(Frozen, time.Now().Add(timeout)); err != nil {
		if terr := c.Thaw(); terr != nil {
			err = errors.Join(err, terr)
		}
		return nil, err
	}
	return c.Thaw, nil
}

// Thaw resumes the cgroup's tasks and waits (up to 10 s) until the kernel says so.
// A cgroup that is gone (its tasks all exited and it was removed) has nothing to
// resume.
func (c Cgroup) Thaw() error {
	err := c.wait(Thawed, time.Now().Add(10*time.Second))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

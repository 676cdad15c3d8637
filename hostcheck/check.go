package hostcheck

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/tidepool-dev/tidepool/kview"
)

// Status is a check's outcome.
type Status string

const (
	// OK: the host has it.
	OK Status = "ok"
	// Missing: the host lacks it; Fix says how to get it.
	Missing Status = "missing"
	// Degraded: it works in part, or Tidepool falls back to something slower, or
	// the probe could not decide (Detail says which).
	Degraded Status = "degraded"
)

// Check is one requirement of this host and what the probe found.
type Check struct {
	// Name is short and stable ("overlayfs data-only lowers"), for scripts too.
	Name   string `json:"name"`
	Status Status `json:"status"`
	// Detail says what was found (versions, paths, the probe's error).
	Detail string `json:"detail,omitempty"`
	// Fix says what to do when Status is not OK.
	Fix string `json:"fix,omitempty"`
	// Required is set for hard requirements: Tidepool cannot run without them.
	Required bool `json:"required"`

	err error // the probe's error, for KernelViews to tell a full root from a host without support
}

// OK reports whether the check passed.
func (c Check) OK() bool { return c.Status == OK }

// Failed reports whether this is a hard requirement that is not met.
func (c Check) Failed() bool { return c.Required && c.Status != OK }

func ok(name, detail string) Check { return Check{Name: name, Status: OK, Detail: detail} }

// Options tell the probes where Tidepool keeps its state.
type Options struct {
	// Root is the Tidepool root (ROOT/cas holds the objects). The xattr and FUSE
	// passthrough probes run on its filesystem; it is created if missing.
	Root string
}

// Host runs every host probe, in a stable order.
func Host(ctx context.Context, opts Options) []Check {
	k := Kernel()
	out := []Check{
		k.Check(),
		Overlay(ctx),
		OverlayDataOnly(ctx, k),
		EROFS(ctx, opts.Root, k),
		FUSE(),
		FUSEPassthrough(ctx, opts.Root, k),
		TrustedXattrs(opts.Root),
	}
	out = append(out, Cgroups()...)
	return out
}

// probeDir is where probes that need the root's filesystem put their scratch files:
// the root if it exists, else its nearest existing ancestor (a host not yet set up
// has no root, and checking it must not create one).
func probeDir(root string) (string, error) {
	if root == "" {
		return "", errors.New("no root given")
	}
	dir := filepath.Clean(root)
	for {
		if st, err := os.Stat(dir); err == nil {
			if !st.IsDir() {
				return "", fmt.Errorf("%s is not a directory", dir)
			}
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no existing directory above %s", root)
		}
		dir = parent
	}
}

// KernelViews tells whether kernel fork views (an EROFS metadata image as an
// overlayfs lower, the object directory as a data-only lower) can run on this host
// with its root at root: nil if so, else an error naming every missing piece. It runs
// the same probes `tidepool doctor` reports.
func KernelViews(ctx context.Context, root string) error {
	k := Kernel()
	var missing []string
	rootFull := false
	for _, c := range []Check{OverlayDataOnly(ctx, k), EROFS(ctx, root, k), TrustedXattrs(root)} {
		if !c.OK() {
			missing = append(missing, fmt.Sprintf("%s: %s (%s)", c.Name, c.Status, c.Detail))
			rootFull = rootFull || full(c.err)
		}
	}
	if len(missing) == 0 {
		// The pieces are there: now mount a real one-file view the way the daemon
		// does, so a nil answer means views work, not merely that they should.
		dir, err := probeDir(root)
		if err == nil {
			err = kview.Probe(dir)
		}
		if err != nil {
			missing = append(missing, fmt.Sprintf("a one-file kernel view: %v", err))
			rootFull = full(err)
		}
	}
	switch {
	case len(missing) > 0 && rootFull:
		return fmt.Errorf("kernel views unavailable: %s: %w", strings.Join(missing, "; "), ErrRootFull)
	case len(missing) > 0:
		return fmt.Errorf("kernel views unavailable: %s: %w", strings.Join(missing, "; "), ErrUnsupported)
	}
	return nil
}

// ErrUnsupported is wrapped by KernelViews' error when the host lacks something.
var ErrUnsupported = errors.New("host does not support it")

// ErrRootFull is wrapped by KernelViews' error when a probe could not write under the
// root because its filesystem is full: the host may support kernel views, but no
// image can be written there now.
var ErrRootFull = errors.New("the root's filesystem is full: free space on it")

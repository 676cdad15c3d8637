package hostcheck

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Overlay mounts a plain overlay (one lower, an upper) and writes through it: the
// snapshotter's containers need nothing more.
func Overlay(_ context.Context) Check {
	c := Check{Name: "overlayfs", Required: true,
		Fix: "load the overlay module (modprobe overlay) or build the kernel with CONFIG_OVERLAY_FS"}
	s, err := newScratch()
	if err != nil {
		return notProbed(c, err)
	}
	defer s.close()
	if err := s.mkdirs("l", "u", "w", "m"); err != nil {
		return failed(c, Degraded, err)
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", s.path("l"), s.path("u"), s.path("w"))
	if err := s.mount("overlay", s.path("m"), "overlay", 0, opts); err != nil {
		return failed(c, Missing, err)
	}
	if err := os.WriteFile(s.path("m/probe"), []byte("x"), 0o600); err != nil {
		return failed(c, Missing, fmt.Errorf("write through overlay: %w", err))
	}
	if _, err := os.Stat(s.path("u/probe")); err != nil {
		return failed(c, Missing, fmt.Errorf("write did not land in the upper dir: %w", err))
	}
	return ok(c.Name, "mount and copy-up work")
}

// probeData is what the data-only lower's blob holds and the metacopy file must read.
const probeData = "tidepool"

// OverlayDataOnly does what a kernel view does: a metadata-only file (an empty file
// of the right size carrying trusted.overlay.metacopy and trusted.overlay.redirect)
// in an upper lower layer, its data in a data-only lower (lowerdir=meta::data,
// kernel >= 6.5, metacopy=on), and reads the data back through the overlay.
func OverlayDataOnly(_ context.Context, k KernelVersion) Check {
	c := Check{Name: "overlayfs data-only lowers + metacopy",
		Fix: "kernel views need kernel >= " + dataOnlyLowers + " with CONFIG_OVERLAY_FS (metacopy is a mount option); until then views are served by FUSE"}
	s, err := newScratch()
	if err != nil {
		return notProbed(c, err)
	}
	defer s.close()
	if err := s.mkdirs("meta", "data", "m"); err != nil {
		return failed(c, Degraded, err)
	}
	if err := os.WriteFile(s.path("data/blob"), []byte(probeData), 0o600); err != nil {
		return failed(c, Degraded, err)
	}
	f := s.path("meta/file")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		return failed(c, Degraded, err)
	}
	if err := os.Truncate(f, int64(len(probeData))); err != nil {
		return failed(c, Degraded, err)
	}
	if err := unix.Setxattr(f, "trusted.overlay.metacopy", nil, 0); err != nil {
		return failed(c, Degraded, fmt.Errorf("set trusted.overlay.metacopy on tmpfs: %w", err))
	}
	if err := unix.Setxattr(f, "trusted.overlay.redirect", []byte("/blob"), 0); err != nil {
		return failed(c, Degraded, fmt.Errorf("set trusted.overlay.redirect on tmpfs: %w", err))
	}
	opts := fmt.Sprintf("lowerdir=%s::%s,metacopy=on,redirect_dir=follow", s.path("meta"), s.path("data"))
	if err := s.mount("overlay", s.path("m"), "overlay", unix.MS_RDONLY, opts); err != nil {
		return failed(c, Missing, fmt.Errorf("%w (kernel %s; data-only lowers need >= %s)", err, k.Release, dataOnlyLowers))
	}
	got, err := os.ReadFile(s.path("m/file"))
	if err != nil {
		return failed(c, Missing, fmt.Errorf("read a metacopy file through the overlay: %w", err))
	}
	if string(got) != probeData {
		return failed(c, Missing, fmt.Errorf("a metacopy file read %q through the overlay, want its data-only lower's %q", got, probeData))
	}
	return ok(c.Name, "lowerdir=meta::data with metacopy=on serves a redirected file's data")
}

// failed fills in a check that did not pass. A probe that could not write its scratch
// files because the filesystem is full says so: the host may well have what the check
// is about, and the fix is space, not a kernel.
func failed(c Check, st Status, err error) Check {
	c.Status, c.Detail, c.err = st, err.Error(), err
	if full(err) {
		c.Status = Degraded
		c.Fix = "free space on the filesystem of the root (or give its user quota), then check again; until then views are served by FUSE"
	}
	return c
}

// full reports whether err says a filesystem has no space (or quota) left.
func full(err error) bool {
	return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)
}

// notProbed reports a probe that could not run (not root): never ok.
func notProbed(c Check, err error) Check {
	c.Status, c.Detail = Degraded, "not probed: "+err.Error()
	if err == errNotRoot {
		c.Fix = "run as root to probe; " + c.Fix
	}
	return c
}

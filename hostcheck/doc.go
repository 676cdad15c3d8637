// Package hostcheck probes what this host offers Tidepool: the kernel's overlayfs
// (data-only lower layers, metacopy), EROFS with file-backed mounts, FUSE and FUSE
// passthrough, the cgroup version and freezer, and trusted.* extended attributes on
// the filesystem holding the Tidepool root.
//
// Why a package of its own: `tidepool doctor` reports these checks to an operator and
// tidepoold's `views.mode = auto` decides between kernel and FUSE views with
// KernelViews. Both must call the same code, or the doctor would promise what the
// daemon then refuses (or the reverse). Wherever the kernel can be asked by doing the
// thing (mounting an overlay with a data-only lower, mounting a tiny EROFS image from
// a file, registering a FUSE backing file, setting a trusted.* xattr) the probe does
// exactly that, on private scratch directories it removes afterwards; kernel version
// numbers are only reported, and used as the explanation when a probe fails.
//
// Probes that mount need root (CAP_SYS_ADMIN); without it they report degraded with
// the reason, never ok.
package hostcheck

package kview

import (
	"context"
	"os"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// prefetchImage asks the kernel to read the whole image into the page cache, at once
// and in the background (POSIX_FADV_WILLNEED), before it is mounted.
//
// EROFS reads the metadata of an image mounted from a file through that file's page
// cache one 4 KiB block at a time, each block a synchronous read the first time a
// lookup needs it, with no readahead. An image that is not in the page cache (after
// a reboot, under memory pressure, or once caches are dropped) thus costs the first
// walk of the view hundreds of small reads: about 540 for the Go source tree's
// 2.7 MiB image, each a round trip to the disk and, on a VM, an exit to the
// hypervisor. One WILLNEED over the file turns them into a few large reads issued
// before the container starts. An image still cached (just built, or in use by
// other views) costs a walk of its pages in the page cache. Failing only costs
// speed, so errors are logged, not returned.
//
// It reports whether the image was cold: fewer than half its pages were cached
// before it asked for them (coldread.go).
func prefetchImage(ctx context.Context, img string) (cold bool) {
	l := log.G(ctx).WithField("image", img)
	f, err := os.OpenFile(img, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		l.WithError(err).Debug("could not prefetch a kernel view image")
		return false
	}
	defer f.Close()
	if cold, err = imageCold(f); err != nil {
		l.WithError(err).Debug("could not tell whether a kernel view image is cached")
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_WILLNEED); err != nil {
		l.WithError(err).Debug("could not prefetch a kernel view image")
	}
	return cold
}

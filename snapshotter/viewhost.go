package snapshotter

import (
	"context"

	"github.com/tidepool-dev/tidepool/casstore"
)

// ViewSpec describes one fork view: which tree, where inside the view, and whom its
// files belong to.
type ViewSpec struct {
	Root     casstore.Hash // zero: mount unbound, Bind later
	Prefix   string        // the workdir relative to the rootfs, e.g. "app"
	UID, GID uint32
	// Image asks for a kernel view's image alone, which the container's overlay
	// layers directly (see ImageLayer); a host that serves the view otherwise (FUSE)
	// ignores it.
	Image bool
}

// ViewHost mounts and unmounts fork views at directories. The snapshotter does not
// care who serves them: this process, or a longer-lived one that keeps running
// containers' views alive across a daemon restart.
type ViewHost interface {
	// Mount serves spec at dir (an existing empty directory).
	Mount(ctx context.Context, dir string, spec ViewSpec) error
	// Bind gives an unbound view its tree. It fails if anything looked up the
	// workdir in the view before, because an overlay above it may have cached that.
	Bind(ctx context.Context, dir string, root casstore.Hash) error
	// Tainted reports whether the workdir in the view at dir was looked up while the
	// view was unbound.
	Tainted(dir string) (bool, error)
	// Mounted reports whether a live view is served at dir.
	Mounted(ctx context.Context, dir string) bool
	// Prebuild prepares what a later Mount of spec would spend long on (a kernel
	// view's image), without mounting anything; a host with nothing to prepare
	// does nothing.
	Prebuild(ctx context.Context, spec ViewSpec) error
	// WarmUp prepares, from what an earlier process left, what the first views
	// after a start would otherwise spend longer on than later ones (a kernel host
	// decodes the trees its recent images showed); a host with nothing to prepare
	// does nothing. The snapshotter calls it once, in the background, when it opens.
	WarmUp(ctx context.Context) error
	// Unmount stops serving dir and detaches it; a dir that is not mounted is fine.
	Unmount(ctx context.Context, dir string) error
	// ImageLayer reports whether the view at dir is a kernel view's image mounted
	// alone, and if so the directory its files' redirects point into: the overlay
	// above must take the image as a lower layer and that directory as its data-only
	// layer, with metacopy=on. It fails when it cannot tell.
	ImageLayer(dir string) (dataDir string, ok bool, err error)
}

package fuse

import (
	"fmt"
	"path"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// DefaultTimeout is how long the kernel may cache entries and attributes when the
// caller does not say. Objects are immutable, so only memory pressure should evict.
const DefaultTimeout = time.Hour

// Options configures one view. The zero value is a good default: tree at the view's
// root, owned by 0:0, mtime = mount time, opens served, passthrough when the kernel
// offers it.
type Options struct {
	// Prefix places the tree under this relative path ("", "app", "srv/api"), so
	// that as an overlay lower the fork merges with the image's own directory there.
	// Parent directories are synthesized, owned by 0:0 with mode 0755.
	Prefix string
	// UID and GID own the tree root and everything below it (trees carry no owners),
	// so that a non-root container user can edit its source through copy-up.
	UID, GID uint32
	// Mtime is the single atime/mtime/ctime of every entry. Zero means mount time.
	Mtime time.Time
	// DisablePassthrough forces reads through this process even when the kernel
	// supports FUSE passthrough. Without it, passthrough is used when available and
	// the view falls back to plain reads silently otherwise.
	DisablePassthrough bool
	// NoOpen turns on kernel open caching. The view answers the kernel's first OPEN
	// with ENOSYS (FUSE "no open" support), and from then on the kernel opens and
	// closes files of this mount without asking: no OPEN, FLUSH or RELEASE requests,
	// and a file's page cache stays valid across opens. Reads arrive by offset and
	// are served from the node's verified object file, opened (and hydrated) at the
	// first read and kept like an open's. A warm open then costs no round trip to
	// this process (tens of microseconds each, which dominates warm reads of many
	// small files; directories still cost an OPENDIR each).
	//
	// The price: passthrough is impossible (there is no open reply to carry a backing
	// file), so every page-cache miss is a READ through this process, and the page
	// cache belongs to the view, not to the object file: N views of one root (N
	// containers) cache a file N times, plus the object file's own cache that the
	// first reads fill, where passthrough views all share the object file's cache. A
	// missing or corrupt object fails reads (EIO) instead of opens, and a file whose
	// size cannot be learnt (missing everywhere) fails lookup and stat, since the
	// kernel would read it as empty. DisablePassthrough is implied. Without kernel
	// support for no-open the view serves opens as usual (with a warning);
	// View.NoOpenActive tells which.
	NoOpen bool
	// Private mounts the view for the mounting user alone: without FUSE's
	// allow_other, no other user's process reaches it, whatever the modes say (a
	// kernel overlay mounted by the same user still reads it, with the mounter's
	// credentials). Without Private the view allows other users and the kernel
	// enforces the reported owner and modes (default_permissions), which only ever
	// grant reading.
	Private bool
	// Limits bound what one directory may hold (MaxEntries) and how deep the view
	// descends (MaxDepth): a directory past them fails with EIO and a log line naming
	// the limit. Zero fields take casstore's defaults.
	Limits casstore.Limits
	// EntryTimeout and AttrTimeout bound kernel caching; zero means DefaultTimeout.
	// Negative lookups are never cached (late binding needs to see them).
	EntryTimeout, AttrTimeout time.Duration
	// Source, if set, supplies objects missing from the local store.
	Source BlobSource
	// Stats receives the view's counters; nil gives the view a Stats of its own.
	// Share one pointer between views to aggregate.
	Stats *Stats
	// Debug logs every FUSE request (very verbose).
	Debug bool
}

// ValidatePrefix checks a placement prefix: empty, or a clean relative path whose
// components are all valid tree entry names, so the tree can only land inside the
// view.
func ValidatePrefix(prefix string) error {
	if prefix == "" {
		return nil
	}
	bad := func(why string) error {
		return fmt.Errorf("invalid prefix %q: %s: %w", prefix, why, errdefs.ErrInvalidArgument)
	}
	if strings.HasPrefix(prefix, "/") {
		return bad("must be relative")
	}
	if path.Clean(prefix) != prefix {
		return bad("must be a clean path (no empty, '.' or '..' components, no trailing '/')")
	}
	for _, c := range strings.Split(prefix, "/") {
		if err := casstore.CheckName(c); err != nil {
			return bad(err.Error())
		}
	}
	return nil
}

func splitPrefix(prefix string) []string {
	if prefix == "" {
		return nil
	}
	return strings.Split(prefix, "/")
}

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
// root, owned by 0:0, mtime = mount time, passthrough when the kernel offers it.
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

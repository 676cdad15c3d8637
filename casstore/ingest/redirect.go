package ingest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Overlayfs with redirect_dir=on renames a directory that has lower content by
// renaming its upper directory and recording where its lower content lies in the
// overlay.redirect xattr: "/a/b" (absolute, from the layer root) or "name" (relative:
// name in the lower directory of the renamed directory's parent), with a whiteout left
// at the source. The kernel resolves it while looking a path up: each upper directory's
// lower directory is its parent's lower directory joined with its own name, or with the
// relative redirect's name, or the absolute redirect's path whatever the parent; an
// opaque directory has none (opaque wins over a redirect) and neither have its
// descendants unless one carries an absolute redirect. Upper follows the same rules,
// with the base tree standing for the lower layer at the prefix. The xattr is input
// read from disk: a malformed value is refused, never resolved.

// lowerRef is where an upper directory's lower directory lies.
type lowerRef struct {
	ok      bool          // the directory has a lower directory at all
	path    []string      // its path from the layer root (valid when ok)
	hasTree bool          // the base has a directory there,
	tree    casstore.Hash // this one
}

// redirect is a parsed, validated overlay.redirect value.
type redirect struct {
	abs   bool
	comps []string // the absolute path's components, or the relative name alone
}

// parseRedirect validates the overlay.redirect value v read from path: an absolute
// path of non-empty components other than "." and "..", or a single such name.
func parseRedirect(path, v string) (redirect, error) {
	bad := func(why string) (redirect, error) {
		return redirect{}, fmt.Errorf("%s: overlay redirect %q %s: %w", path, v, why, ErrRedirect)
	}
	if strings.IndexByte(v, 0) >= 0 {
		return bad("holds a NUL byte")
	}
	rel, abs := strings.CutPrefix(v, "/")
	if !abs && strings.Contains(v, "/") {
		return bad("is relative but names a path")
	}
	comps := strings.Split(rel, "/")
	for _, c := range comps {
		if c == "" || c == "." || c == ".." {
			return bad("is not a clean path")
		}
	}
	return redirect{abs: abs, comps: comps}, nil
}

// prefixComps is the layer path of the base tree's root.
func (b *builder) prefixComps() []string {
	if b.prefix == "" {
		return nil
	}
	return strings.Split(b.prefix, "/")
}

// inBase says whether a layer path lies in the base tree and returns its path there.
func (b *builder) inBase(comps []string) (string, bool) {
	pc := b.prefixComps()
	if len(comps) < len(pc) || !slices.Equal(comps[:len(pc)], pc) {
		return "", false
	}
	return strings.Join(comps[len(pc):], "/"), true
}

// baseAt returns the base entry at a layer path; ok is false when the base has none.
// A path outside the base tree (the image's own content) is an error wrapping
// ErrRedirect: Upper cannot see it.
func (b *builder) baseAt(path, what string, comps []string) (casstore.Entry, bool, error) {
	rel, ok := b.inBase(comps)
	if !ok {
		return casstore.Entry{}, false, fmt.Errorf("%s %s %q, outside the tree at %q: %w",
			path, what, "/"+strings.Join(comps, "/"), "/"+b.prefix, ErrRedirect)
	}
	if rel == "" {
		return casstore.Entry{Mode: casstore.ModeDir, Hash: b.base}, true, nil
	}
	return b.baseLookup(rel)
}

// dirLower resolves the lower directory of the upper directory path (named name in
// its parent, whose lower is parent) from its overlay xattrs. It reads no tree: the
// walk reads a directory's base tree when it gets there.
func (b *builder) dirLower(path, name string, parent lowerRef, a ovlAttrs) (lowerRef, error) {
	l, err := lowerPath(path, name, parent, a)
	if err != nil {
		return lowerRef{}, err
	}
	return b.resolve(path, l)
}

// lowerPath follows the kernel's rules for where an upper directory's lower directory
// lies, as a layer path only (no base tree looked up): the directories on the way to
// the prefix lie outside the base tree.
func lowerPath(path, name string, parent lowerRef, a ovlAttrs) (lowerRef, error) {
	switch {
	case a.opaque:
		return lowerRef{}, nil
	case a.redirect:
		r, err := parseRedirect(path, a.target)
		switch {
		case err != nil:
			return lowerRef{}, err
		case r.abs:
			return lowerRef{ok: true, path: r.comps}, nil
		case !parent.ok:
			return lowerRef{}, nil
		}
		name = r.comps[0]
	case !parent.ok:
		return lowerRef{}, nil
	}
	return lowerRef{ok: true, path: append(slices.Clip(parent.path), name)}, nil
}

// resolve finds the base directory at l's path: l unchanged if it has no lower
// directory, an error if its path lies outside the base tree.
func (b *builder) resolve(path string, l lowerRef) (lowerRef, error) {
	if !l.ok {
		return l, nil
	}
	e, ok, err := b.baseAt(path, "is a renamed directory whose content is", l.path)
	if err != nil {
		return lowerRef{}, err
	}
	l.hasTree, l.tree = ok && e.Mode.IsDir(), e.Hash
	return l, nil
}

// lowerFile finds the data of a metadata-only copy-up whose origin (at layer path
// comps) the base does not hold: the first of Options.Lowers (top first) with a regular
// file there, unless a whiteout, a non-directory on the way or an opaque directory
// above the layers that hold it hides it. It returns the file's path, or "" if no layer
// shows one.
func (b *builder) lowerFile(comps []string) (string, error) {
	for _, layer := range b.opts.Lowers {
		p, opaque := layer, false
		for i, c := range comps {
			p = childPath(p, c)
			info, err := os.Lstat(p)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				if opaque {
					return "", nil // an opaque directory in this layer hides the layers below
				}
			case err != nil:
				return "", fmt.Errorf("stat %s: %w", p, err)
			case i == len(comps)-1:
				if !info.Mode().IsRegular() {
					return "", nil // a whiteout, a directory, ...
				}
				a, err := overlayAttrs(p)
				if err != nil {
					return "", err
				}
				if a.whiteout && info.Size() == 0 {
					return "", nil
				}
				return p, nil
			case !info.IsDir():
				return "", nil
			default:
				a, err := overlayAttrs(p)
				if err != nil {
					return "", err
				}
				opaque = opaque || a.opaque
				continue
			}
			break // not in this layer: look further down
		}
	}
	return "", nil
}

// errNoOrigin is the error for a metadata-only copy-up whose data nothing holds.
func errNoOrigin(path string) error {
	return fmt.Errorf("%s is a metadata-only copy-up but the base has no regular file at its origin: %w",
		path, errdefs.ErrFailedPrecondition)
}

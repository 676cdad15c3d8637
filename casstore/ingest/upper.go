package ingest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"syscall"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Upper commits an overlayfs upper directory over a base root: it returns the root of
// the tree that the overlay's merged view shows under prefix, where the base tree was
// placed in a lower layer. prefix is a clean relative path ("app", "srv/api"), or ""
// when the tree is the upper's root; everything outside it (changes to the image) is
// ignored.
//
// Only upperDir/prefix is walked, and only the base trees on the paths to changed
// entries are read; every untouched subtree keeps its hash, so the cost is O(changed)
// whatever the size of the base. Overlay semantics are those of Linux overlayfs: a
// whiteout (character device 0/0, or a zero-size file with an overlay.whiteout xattr)
// deletes, an opaque directory (overlay.opaque="y") replaces, a plain directory merges
// over its lower directory; a directory with overlay.redirect (redirect_dir: a renamed
// directory) merges over the base directory its redirect names, resolved as the kernel
// does (redirect.go), and one whose redirect leaves the base tree is an error wrapping
// ErrRedirect; a file with overlay.metacopy keeps the content of its origin (the same
// name in its directory's lower directory, or the one its overlay.redirect names) with
// the upper's mode, found in the base or else in Options.Lowers; FIFOs, sockets and
// devices hide the base entry and add nothing; symlinks are recorded (or, with
// LunarStrict, hide the base entry). If the prefix, or one of its
// ancestors, was deleted or replaced by a non-directory, the result is the empty tree.
//
// Names follow Dir's rules (".git" skipped, lossy UTF-8, collisions are errors), so for
// a base made by Dir or Upper with the same Options the result equals Dir of the merged
// directory. Like Dir, Upper writes through one batch and leaves the store unchanged on
// error.
func Upper(ctx context.Context, store *casstore.Store, base casstore.Hash, upperDir, prefix string, opts Options) (casstore.Hash, error) {
	h, _, err := UpperStats(ctx, store, base, upperDir, prefix, opts)
	return h, err
}

// UpperStats is Upper, also returning what was stored and what was left out.
func UpperStats(ctx context.Context, store *casstore.Store, base casstore.Hash, upperDir, prefix string, opts Options) (casstore.Hash, Stats, error) {
	if err := ValidatePrefix(prefix); err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("commit %s: %w", upperDir, err)
	}
	if base.IsZero() {
		return casstore.Hash{}, Stats{}, fmt.Errorf("commit %s: no base root: %w", upperDir, errInvalid)
	}
	root, err := canonicalDir(upperDir)
	if err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("commit %s: %w", upperDir, err)
	}
	if prefix == "." {
		prefix = ""
	}
	h, st, err := build(ctx, store, opts, func(b *builder) (*dirNode, error) {
		b.base, b.prefix = base, prefix
		return b.upperPrefix(ctx, root, prefix)
	})
	if err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("commit %s over %s: %w", upperDir, base.Short(), err)
	}
	return h, st, nil
}

// upperPrefix finds what became of the prefix directory in the upper and merges it.
// The lower directory of each directory on the way follows overlayfs's lookup
// (redirect.go); the prefix directory's must lie in the base tree.
func (b *builder) upperPrefix(ctx context.Context, root, prefix string) (*dirNode, error) {
	path := root
	// The kernel never treats the upper's root as opaque or redirected, so its xattrs
	// are not read: its lower is the layer root.
	lower := lowerRef{ok: true}
	if prefix != "" {
		comps := strings.Split(prefix, "/")
		for i, comp := range comps {
			path = childPath(path, comp)
			info, err := os.Lstat(path)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				if !lower.ok {
					// An opaque ancestor hides the base, and the upper has no prefix dir.
					return &dirNode{path: path}, nil
				}
				// Nothing changed under the prefix: the merged prefix is its lower
				// directory as it is (the base itself unless a redirect moved it).
				l, err := b.resolve(path, lowerRef{ok: true, path: append(slices.Clip(lower.path), comps[i:]...)})
				if err != nil {
					return nil, err
				}
				t, err := b.lowerTree(path, l)
				if err != nil {
					return nil, err
				}
				return baseNode(path, t), nil
			case err != nil:
				return nil, fmt.Errorf("stat %s: %w", path, err)
			case !info.IsDir():
				log.G(ctx).WithField("path", path).Debug("commit: workdir prefix was deleted in the upper; the new root is empty")
				return &dirNode{path: path}, nil
			}
			a, err := overlayAttrs(path)
			if err != nil {
				return nil, err
			}
			if lower, err = lowerPath(path, comp, lower, a); err != nil {
				return nil, err
			}
		}
	}
	lower, err := b.resolve(path, lower)
	if err != nil {
		return nil, err
	}
	return b.mergeDir(path, lower)
}

// lowerTree reads the base tree of a lower directory (nil if the base has none there).
func (b *builder) lowerTree(path string, l lowerRef) (casstore.Tree, error) {
	if !l.hasTree {
		return nil, nil
	}
	t, err := b.store.ReadTree(l.tree)
	if err != nil {
		return nil, fmt.Errorf("read base tree for %s: %w", path, err)
	}
	return t, nil
}

// baseNode is a directory taken from the base unchanged.
func baseNode(path string, t casstore.Tree) *dirNode {
	n := &dirNode{path: path, children: make([]child, len(t))}
	for i, e := range t {
		n.children[i] = child{name: e.Name, raw: e.Name, mode: e.Mode, hash: e.Hash}
	}
	return n
}

// mergeDir builds the merged view of one upper directory over its lower directory
// (whose base tree, if any, is read here). Base entries whose name the upper does not
// hold are reused by hash; the rest follows the upper.
func (b *builder) mergeDir(path string, lower lowerRef) (*dirNode, error) {
	if err := b.ctx.Err(); err != nil {
		return nil, err
	}
	base, err := b.lowerTree(path, lower)
	if err != nil {
		return nil, err
	}
	ents, err := readDir(path)
	if err != nil {
		return nil, err
	}
	b.c.dirs++
	inUpper := make(map[string]struct{}, len(ents))
	for _, e := range ents {
		inUpper[e.Name()] = struct{}{}
	}
	n := &dirNode{path: path, children: make([]child, 0, len(base)+len(ents))}
	for _, e := range base {
		if _, hidden := inUpper[e.Name]; !hidden {
			n.children = append(n.children, child{name: e.Name, raw: e.Name, mode: e.Mode, hash: e.Hash})
		}
	}
	for _, e := range ents {
		name := e.Name()
		if name == gitDir {
			b.c.skipped++
			continue
		}
		p := childPath(path, name)
		info, err := e.Info()
		if err != nil {
			return nil, fmt.Errorf("stat %s: %w", p, err)
		}
		mode := info.Mode()
		switch {
		case mode.IsDir():
			a, err := overlayAttrs(p)
			if err != nil {
				return nil, err
			}
			l, err := b.dirLower(p, name, lower, a)
			if err != nil {
				return nil, err
			}
			n.children = append(n.children, child{name: lossyName(name), raw: name, mode: casstore.ModeDir, walk: true, lower: l})
		case mode.IsRegular():
			a, err := overlayAttrs(p)
			if err != nil {
				return nil, err
			}
			if a.whiteout && info.Size() == 0 {
				continue
			}
			c := child{name: lossyName(name), raw: name, mode: execMode(uint32(mode.Perm()))}
			if a.metacopy {
				// A redirect on a file only matters while its data is still below.
				if c.hash, c.src, err = b.metacopyData(p, name, lower, base, a); err != nil {
					return nil, err
				}
				c.file, c.size = c.src != "", info.Size()
			} else {
				c.file, c.size = true, info.Size()
			}
			n.children = append(n.children, c)
		case mode&fs.ModeSymlink != 0 && !b.opts.LunarStrict:
			h, err := b.symlink(p)
			if err != nil {
				return nil, err
			}
			n.children = append(n.children, child{name: lossyName(name), raw: name, mode: casstore.ModeSymlink, hash: h})
		default:
			// A whiteout (char device 0/0) deletes; any other special file, or a symlink
			// with LunarStrict, hides the base entry and is skipped as Dir would.
			st, ok := info.Sys().(*syscall.Stat_t)
			switch {
			case ok && mode&fs.ModeCharDevice != 0 && st.Rdev == 0: // whiteout
			case mode&fs.ModeSymlink != 0:
				b.c.skipped++
			default:
				if err := b.special(p, mode); err != nil {
					return nil, err
				}
			}
		}
	}
	if err := checkCollisions(path, n.children); err != nil {
		return nil, err
	}
	b.queueFiles(n)
	for i := range n.children {
		c := &n.children[i]
		if !c.walk {
			continue
		}
		if c.dir, err = b.mergeDir(childPath(path, c.raw), c.lower); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// metacopyData finds the content of a metadata-only copy-up: the base file at its
// origin, the file of the same name in the lower directory or the one its redirect
// names (overlayfs sets one when such a file is renamed or hard-linked). It returns
// the base object, or else the path of the origin in Options.Lowers (the image's own
// layers), whose data is stored as a new file.
func (b *builder) metacopyData(path, name string, lower lowerRef, dir casstore.Tree, a ovlAttrs) (casstore.Hash, string, error) {
	var origin []string // layer path of the origin; nil: none
	sameDir := true     // the origin is an entry of the lower directory, dir
	switch {
	case a.redirect:
		r, err := parseRedirect(path, a.target)
		if err != nil {
			return casstore.Hash{}, "", err
		}
		if r.abs {
			origin, sameDir = r.comps, false
		} else if lower.ok {
			origin, name = append(slices.Clip(lower.path), r.comps[0]), r.comps[0]
		}
	case lower.ok:
		origin = append(slices.Clip(lower.path), name)
	}
	if origin == nil {
		return casstore.Hash{}, "", errNoOrigin(path)
	}
	var e casstore.Entry
	var found bool
	_, inBase := b.inBase(origin)
	switch {
	case inBase && sameDir:
		e, found = dir.Lookup(name)
	case inBase:
		var err error
		if e, found, err = b.baseAt(path, "", origin); err != nil {
			return casstore.Hash{}, "", err
		}
	case len(b.opts.Lowers) == 0:
		return casstore.Hash{}, "", fmt.Errorf("metadata-only copy-up %s takes its data from %q, outside the tree at %q, and no image layers were given: %w",
			path, "/"+strings.Join(origin, "/"), "/"+b.prefix, errdefs.ErrFailedPrecondition)
	}
	switch {
	case found && (e.Mode == casstore.ModeFile || e.Mode == casstore.ModeExec):
		return e.Hash, "", nil
	case found: // a directory or symlink of the base hides any origin below
		return casstore.Hash{}, "", errNoOrigin(path)
	}
	src, err := b.lowerFile(origin)
	if err != nil {
		return casstore.Hash{}, "", err
	}
	if src == "" {
		return casstore.Hash{}, "", errNoOrigin(path)
	}
	return casstore.Hash{}, src, nil
}

// baseLookup finds the entry at a slash-separated path in the base root, reading only
// the trees along it.
func (b *builder) baseLookup(rel string) (casstore.Entry, bool, error) {
	e := casstore.Entry{Mode: casstore.ModeDir, Hash: b.base}
	for _, comp := range strings.Split(rel, "/") {
		if !e.Mode.IsDir() {
			return casstore.Entry{}, false, nil
		}
		t, err := b.store.ReadTree(e.Hash)
		if err != nil {
			return casstore.Entry{}, false, fmt.Errorf("read base tree: %w", err)
		}
		var ok bool
		if e, ok = t.Lookup(comp); !ok {
			return casstore.Entry{}, false, nil
		}
	}
	return e, true, nil
}

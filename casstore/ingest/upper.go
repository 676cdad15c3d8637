package ingest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
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
// over a base directory; a file with overlay.metacopy keeps the content of its origin
// in the base (the same path, or the one its overlay.redirect names) with the upper's
// mode; FIFOs, sockets and devices hide the base entry and add nothing; symlinks are
// recorded (or, with LunarStrict, hide the base entry). A directory with
// overlay.redirect (redirect_dir) is an error wrapping ErrRedirect. If the prefix, or one of its
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
		return b.upperPrefix(ctx, base, root, prefix)
	})
	if err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("commit %s over %s: %w", upperDir, base.Short(), err)
	}
	return h, st, nil
}

// upperPrefix finds what became of the prefix directory in the upper and merges it.
func (b *builder) upperPrefix(ctx context.Context, base casstore.Hash, root, prefix string) (*dirNode, error) {
	baseTree, err := b.store.ReadTree(base)
	if err != nil {
		return nil, fmt.Errorf("read base root: %w", err)
	}
	path := root
	opaque := false
	if prefix != "" {
		for _, comp := range strings.Split(prefix, "/") {
			path = childPath(path, comp)
			info, err := os.Lstat(path)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				if opaque {
					// An opaque ancestor hides the base, and the upper has no prefix dir.
					return &dirNode{path: path}, nil
				}
				// Nothing changed under the prefix: the base, as it was.
				return baseNode(path, baseTree), nil
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
			if a.redirect {
				return nil, fmt.Errorf("%s: %w", path, ErrRedirect)
			}
			opaque = opaque || a.opaque
		}
	}
	// The kernel never treats the upper's root as opaque, so its xattrs are not read.
	if opaque {
		baseTree = nil
	}
	return b.mergeDir(path, baseTree)
}

// baseNode is a directory taken from the base unchanged.
func baseNode(path string, t casstore.Tree) *dirNode {
	n := &dirNode{path: path, children: make([]child, len(t))}
	for i, e := range t {
		n.children[i] = child{name: e.Name, raw: e.Name, mode: e.Mode, hash: e.Hash}
	}
	return n
}

// mergeDir builds the merged view of one upper directory over base (nil when there is
// no base directory or it is hidden). Base entries whose name the upper does not hold
// are reused by hash; the rest follows the upper.
func (b *builder) mergeDir(path string, base casstore.Tree) (*dirNode, error) {
	if err := b.ctx.Err(); err != nil {
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
			if a.redirect {
				return nil, fmt.Errorf("%s: %w", p, ErrRedirect)
			}
			c := child{name: lossyName(name), raw: name, mode: casstore.ModeDir, walk: true}
			if be, ok := base.Lookup(name); ok && be.Mode.IsDir() && !a.opaque {
				c.hasBase, c.base = true, be.Hash
			}
			n.children = append(n.children, c)
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
				if c.hash, err = b.metacopyData(p, name, base, a); err != nil {
					return nil, err
				}
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
		var sub casstore.Tree
		if c.hasBase {
			if sub, err = b.store.ReadTree(c.base); err != nil {
				return nil, fmt.Errorf("read base tree for %s: %w", childPath(path, c.raw), err)
			}
		}
		if c.dir, err = b.mergeDir(childPath(path, c.raw), sub); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// metacopyData finds the content of a metadata-only copy-up in the base: the file of
// the same name in the base directory, or the one its redirect names (overlayfs sets
// one when such a file is renamed or hard-linked).
func (b *builder) metacopyData(path, name string, dir casstore.Tree, a ovlAttrs) (casstore.Hash, error) {
	lookup := func() (casstore.Entry, bool, error) {
		if !a.redirect {
			e, ok := dir.Lookup(name)
			return e, ok, nil
		}
		if !strings.HasPrefix(a.target, "/") { // relative: same lower directory
			e, ok := dir.Lookup(a.target)
			return e, ok, nil
		}
		rel, ok := strings.CutPrefix(a.target, "/"+b.prefix)
		if b.prefix == "" {
			rel, ok = a.target, true
		}
		if !ok || (rel != "" && rel[0] != '/') {
			return casstore.Entry{}, false, fmt.Errorf("metadata-only copy-up %s takes its data from %q, outside the tree at %q: %w",
				path, a.target, "/"+b.prefix, errdefs.ErrFailedPrecondition)
		}
		return b.baseLookup(strings.Trim(rel, "/"))
	}
	e, ok, err := lookup()
	if err != nil {
		return casstore.Hash{}, err
	}
	if !ok || (e.Mode != casstore.ModeFile && e.Mode != casstore.ModeExec) {
		return casstore.Hash{}, fmt.Errorf("%s is a metadata-only copy-up but the base has no regular file at its origin: %w",
			path, errdefs.ErrFailedPrecondition)
	}
	return e.Hash, nil
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

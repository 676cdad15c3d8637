package ingest

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Dir ingests the directory tree at path into store and returns its root hash.
//
// The rules are LunarFS's (lunarfs-format.md §2.4): a symlink at path itself is
// followed; entries named exactly ".git" are skipped at any depth; empty directories
// are kept; a regular file is executable if any x bit is set; names are converted to
// UTF-8 lossily; FIFOs, sockets and devices are skipped. Symlinks are recorded as
// casstore.ModeSymlink entries whose blob is the link target, or dropped with
// Options.LunarStrict. Unlike LunarFS there are no size caps, and two names that become
// equal after the UTF-8 conversion are an error (ErrNameCollision) rather than a
// duplicate entry; so is any read error, on a file or on a directory.
//
// Every object goes through one batch, committed only on success: after an error or a
// cancelled ctx the store holds exactly what it held before.
func Dir(ctx context.Context, store *casstore.Store, path string, opts Options) (casstore.Hash, Stats, error) {
	root, err := canonicalDir(path)
	if err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("ingest %s: %w", path, err)
	}
	h, st, err := build(ctx, store, opts, func(b *builder) (*dirNode, error) {
		return b.walkDir(root)
	})
	if err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("ingest %s: %w", path, err)
	}
	return h, st, nil
}

// canonicalDir makes path absolute, resolves symlinks in it (the root itself included)
// and checks that it is a directory.
func canonicalDir(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return "", err
	}
	st, err := os.Stat(real)
	if err != nil {
		return "", err
	}
	if !st.IsDir() {
		return "", fmt.Errorf("%s is not a directory: %w", real, errInvalid)
	}
	return real, nil
}

// readDir lists a directory sorted by raw name bytes. The directory is opened with
// O_NOFOLLOW, so a directory swapped for a symlink during the walk is an error instead
// of a way out of the tree.
func readDir(path string) ([]os.DirEntry, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("read directory %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	ents, err := f.ReadDir(-1)
	if err != nil {
		return nil, fmt.Errorf("read directory %s: %w", path, err)
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
	return ents, nil
}

// walkDir builds the node for one directory: its files go to the workers, then its
// subdirectories are walked in name order.
func (b *builder) walkDir(path string) (*dirNode, error) {
	if err := b.ctx.Err(); err != nil {
		return nil, err
	}
	ents, err := readDir(path)
	if err != nil {
		return nil, err
	}
	b.c.dirs++
	n := &dirNode{path: path, children: make([]child, 0, len(ents))}
	for _, e := range ents {
		name := e.Name()
		if name == gitDir {
			b.c.skipped++
			continue
		}
		p := childPath(path, name)
		switch t := e.Type(); {
		case t.IsDir():
			n.children = append(n.children, child{name: lossyName(name), raw: name, mode: casstore.ModeDir, walk: true})
		case t.IsRegular():
			info, err := e.Info()
			if err != nil {
				return nil, fmt.Errorf("stat %s: %w", p, err)
			}
			n.children = append(n.children, child{
				name: lossyName(name), raw: name, mode: execMode(uint32(info.Mode().Perm())),
				file: true, size: info.Size(),
			})
		case t&fs.ModeSymlink != 0 && !b.opts.LunarStrict:
			h, err := b.symlink(p)
			if err != nil {
				return nil, err
			}
			n.children = append(n.children, child{name: lossyName(name), raw: name, mode: casstore.ModeSymlink, hash: h})
		case t&fs.ModeSymlink != 0: // with LunarStrict
			b.c.skipped++
		default: // FIFOs, sockets, devices
			if err := b.special(p, t); err != nil {
				return nil, err
			}
		}
	}
	if err := checkCollisions(path, n.children); err != nil {
		return nil, err
	}
	b.queueFiles(n)
	for i := range n.children {
		if c := &n.children[i]; c.walk {
			if c.dir, err = b.walkDir(childPath(path, c.raw)); err != nil {
				return nil, err
			}
		}
	}
	return n, nil
}

// Package checkout materializes a root of the content-addressed store as an ordinary
// directory tree, for tools that need real files (builds, `git diff --no-index`, a
// container image layer) rather than a FUSE view.
//
// Every entry is created relative to a descriptor of the directory that was just
// created for it (mkdirat, openat with O_EXCL|O_NOFOLLOW, symlinkat), so neither a
// symlink in the tree nor one planted by another process can redirect a write outside
// the target. Content is streamed from verified objects, never held whole in memory.
// A failed checkout removes everything it created.
package checkout

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// maxLinkTarget is the longest symlink target Linux accepts (PATH_MAX - 1).
const maxLinkTarget = 4095

// Options tune a checkout.
type Options struct {
	// Prefix places the tree under DIR/Prefix instead of DIR itself: a relative,
	// '/'-separated path without "." or ".." components.
	Prefix string
	// Limits bound the tree: one past them is refused before anything is written
	// (zero fields: casstore's defaults).
	Limits casstore.Limits
}

// Stats counts what a checkout created.
type Stats struct {
	Files    int   // regular files, executable or not
	Dirs     int   // directories, not counting DIR and the prefix
	Symlinks int   // symbolic links
	Bytes    int64 // file content written
}

// Checkout writes the tree named root into dir, which must not exist or be empty.
// Directories get mode 0755, files 0644 or 0755 and symlinks their stored target,
// whatever the umask. On error nothing it created is left behind, and the error names
// the path and the object that failed.
func Checkout(ctx context.Context, s *casstore.Store, root casstore.Hash, dir string, opts Options) (st Stats, err error) {
	prefix, err := SplitPrefix(opts.Prefix)
	if err != nil {
		return Stats{}, err
	}
	// Other errors (a missing or corrupt object) are left to the walk, which names
	// the path they are at.
	if _, err := casstore.Measure(ctx, s, root, opts.Limits, true); errors.Is(err, casstore.ErrTreeLimit) || ctx.Err() != nil {
		return Stats{}, fmt.Errorf("checkout %s: %w", root.Short(), err)
	}
	undo, err := prepare(dir)
	if err != nil {
		return Stats{}, err
	}
	c := &checker{ctx: ctx, s: s, st: &st}
	defer func() {
		if err != nil {
			undo(c.top)
			st = Stats{}
		}
	}()

	top, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return st, fmt.Errorf("checkout: open %s: %w", dir, err)
	}
	defer unix.Close(top)
	c.topFD = top
	dfd, path := top, ""
	defer func() {
		if dfd != top {
			unix.Close(dfd)
		}
	}()
	for _, name := range prefix {
		fd, err := c.mkdir(dfd, path, name)
		if err != nil {
			return st, err
		}
		if dfd != top {
			unix.Close(dfd)
		}
		dfd, path = fd, join(path, name)
	}
	c.st.Dirs = 0 // the prefix directories are not part of the tree
	return st, c.tree(dfd, path, root)
}

// SplitPrefix validates a checkout or view prefix and returns its components. An empty
// prefix gives none. Every component must be a safe entry name (casstore.CheckName).
func SplitPrefix(prefix string) ([]string, error) {
	if strings.HasPrefix(prefix, "/") {
		return nil, fmt.Errorf("prefix %q must be relative: %w", prefix, errdefs.ErrInvalidArgument)
	}
	p := strings.TrimSuffix(prefix, "/")
	if p == "" {
		return nil, nil
	}
	parts := strings.Split(p, "/")
	for _, name := range parts {
		if err := casstore.CheckName(name); err != nil {
			return nil, fmt.Errorf("prefix %q: %w: %w", prefix, err, errdefs.ErrInvalidArgument)
		}
	}
	return parts, nil
}

// prepare makes sure dir exists and is empty. It returns how to undo a failed
// checkout: remove what was created, from the first directory that did not exist, or
// else the top-level entries the checkout created inside the existing empty dir.
func prepare(dir string) (undo func(top []string), err error) {
	fi, err := os.Stat(dir)
	switch {
	case err == nil:
		if !fi.IsDir() {
			return nil, fmt.Errorf("checkout: %s exists and is not a directory: %w", dir, errdefs.ErrAlreadyExists)
		}
		f, err := os.Open(dir)
		if err != nil {
			return nil, fmt.Errorf("checkout: %w", err)
		}
		names, err := f.Readdirnames(1)
		f.Close()
		if len(names) > 0 {
			return nil, fmt.Errorf("checkout: %s is not empty: %w", dir, errdefs.ErrAlreadyExists)
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("checkout: read %s: %w", dir, err)
		}
		return func(top []string) {
			for _, name := range top {
				os.RemoveAll(filepath.Join(dir, name))
			}
		}, nil
	case errors.Is(err, fs.ErrNotExist):
		abs, err := filepath.Abs(dir)
		if err != nil {
			return nil, fmt.Errorf("checkout: %w", err)
		}
		first := abs
		for {
			parent := filepath.Dir(first)
			if parent == first {
				break
			}
			if _, err := os.Lstat(parent); err == nil {
				break
			}
			first = parent
		}
		if err := os.MkdirAll(abs, 0o755); err != nil {
			os.RemoveAll(first)
			return nil, fmt.Errorf("checkout: %w", err)
		}
		// What we created gets 0755 like every directory of the tree, whatever the umask.
		for d := abs; ; d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o755); err != nil {
				os.RemoveAll(first)
				return nil, fmt.Errorf("checkout: %w", err)
			}
			if d == first {
				break
			}
		}
		return func([]string) { os.RemoveAll(first) }, nil
	default:
		return nil, fmt.Errorf("checkout: %w", err)
	}
}

type checker struct {
	ctx   context.Context
	s     *casstore.Store
	st    *Stats
	topFD int
	top   []string // entries created directly in the target directory
}

func (c *checker) created(dfd int, name string) {
	if dfd == c.topFD {
		c.top = append(c.top, name)
	}
}

// fail wraps err with the path and the object it concerns.
func fail(path string, mode casstore.Mode, h casstore.Hash, err error) error {
	kind := "blob"
	switch mode {
	case casstore.ModeDir:
		kind = "tree"
	case casstore.ModeSymlink:
		kind = "symlink target"
	}
	where := "/"
	if path != "" {
		where = path
	}
	return fmt.Errorf("checkout %q (%s %s): %w", where, kind, h, err)
}

// tree fills the directory open as dfd with the entries of tree h.
func (c *checker) tree(dfd int, path string, h casstore.Hash) error {
	if err := c.ctx.Err(); err != nil {
		return err
	}
	t, err := c.s.ReadTree(h)
	if err != nil {
		return fail(path, casstore.ModeDir, h, err)
	}
	for _, e := range t {
		if err := c.ctx.Err(); err != nil {
			return err
		}
		p := join(path, e.Name)
		if err := casstore.CheckName(e.Name); err != nil {
			return fail(p, e.Mode, e.Hash, err)
		}
		switch e.Mode {
		case casstore.ModeDir:
			fd, err := c.mkdir(dfd, path, e.Name)
			if err != nil {
				return err
			}
			err = c.tree(fd, p, e.Hash)
			unix.Close(fd)
			if err != nil {
				return err
			}
		case casstore.ModeSymlink:
			if err := c.symlink(dfd, p, e); err != nil {
				return err
			}
		case casstore.ModeFile, casstore.ModeExec:
			if err := c.file(dfd, p, e); err != nil {
				return err
			}
		default:
			return fail(p, e.Mode, e.Hash, fmt.Errorf("unknown mode %o", uint32(e.Mode)))
		}
	}
	return nil
}

// mkdir creates name in dfd and returns a descriptor of the new directory, opened
// without following symlinks so it is the directory just made.
func (c *checker) mkdir(dfd int, parent, name string) (int, error) {
	p := join(parent, name)
	if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
		return -1, fmt.Errorf("checkout %q: mkdir: %w", p, err)
	}
	c.created(dfd, name)
	fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("checkout %q: open directory: %w", p, err)
	}
	if err := unix.Fchmod(fd, 0o755); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("checkout %q: chmod: %w", p, err)
	}
	c.st.Dirs++
	return fd, nil
}

func (c *checker) symlink(dfd int, p string, e casstore.Entry) error {
	target, err := c.s.ReadAll(e.Hash, maxLinkTarget)
	if err != nil {
		return fail(p, e.Mode, e.Hash, err)
	}
	switch {
	case len(target) == 0:
		return fail(p, e.Mode, e.Hash, errors.New("symlink has an empty target"))
	case strings.IndexByte(string(target), 0) >= 0:
		return fail(p, e.Mode, e.Hash, errors.New("symlink target contains NUL"))
	}
	if err := unix.Symlinkat(string(target), dfd, e.Name); err != nil {
		return fmt.Errorf("checkout %q: symlink: %w", p, err)
	}
	c.created(dfd, e.Name)
	c.st.Symlinks++
	return nil
}

func (c *checker) file(dfd int, p string, e casstore.Entry) error {
	var src *os.File
	if e.Hash != casstore.EmptyHash { // H("") needs no object: its content is known
		var err error
		if src, err = c.s.Open(e.Hash); err != nil {
			return fail(p, e.Mode, e.Hash, err)
		}
		defer src.Close()
	}
	fd, err := unix.Openat(dfd, e.Name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("checkout %q: create: %w", p, err)
	}
	c.created(dfd, e.Name)
	dst := os.NewFile(uintptr(fd), p)
	var n int64
	if src != nil {
		n, err = io.Copy(dst, src)
		if err != nil {
			dst.Close()
			return fail(p, e.Mode, e.Hash, fmt.Errorf("copy: %w", err))
		}
	}
	perm := uint32(0o644)
	if e.Mode == casstore.ModeExec {
		perm = 0o755
	}
	if err := unix.Fchmod(fd, perm); err != nil {
		dst.Close()
		return fmt.Errorf("checkout %q: chmod: %w", p, err)
	}
	if err := dst.Close(); err != nil {
		return fmt.Errorf("checkout %q: %w", p, err)
	}
	c.st.Files++
	c.st.Bytes += n
	return nil
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

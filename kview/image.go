package kview

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"
	"lukechampine.com/blake3"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Mtime is the one modification time of every inode of every image (and the images'
// build time, which lets EROFS use its compact 32-byte inodes). A fixed value keeps
// images byte-reproducible: 2000-01-01T00:00:00Z.
const Mtime = 946684800

// formatVersion changes whenever the image layout for a given Spec changes, so a
// cache filled by an older binary is not reused.
const formatVersion = "tidepool-kview-1"

// maxSymlinkTarget bounds a symlink object (PATH_MAX).
const maxSymlinkTarget = 4096

// The overlayfs xattrs of a metacopy file whose data lives in a data-only lower.
const (
	xattrMetacopy = "trusted.overlay.metacopy"
	xattrRedirect = "trusted.overlay.redirect"
)

// Spec is one view: which tree, where inside the view, and whom its files belong to.
type Spec struct {
	Root     casstore.Hash
	Prefix   string // relative, clean; its parent directories are owned by 0:0
	UID, GID uint32
}

// Key names the image of s: a hash of the image format version and the spec, in hex.
func (s Spec) Key() string {
	h := blake3.New(16, nil)
	var b [8]byte
	io.WriteString(h, formatVersion)
	h.Write([]byte{0})
	h.Write(s.Root[:])
	io.WriteString(h, s.Prefix)
	h.Write([]byte{0})
	binary.LittleEndian.PutUint32(b[:4], s.UID)
	binary.LittleEndian.PutUint32(b[4:], s.GID)
	h.Write(b[:])
	return fmt.Sprintf("%x", h.Sum(nil))
}

// MissingError says a tree references objects that are not in the local store.
type MissingError struct {
	Root    casstore.Hash
	Objects []casstore.Hash // the missing objects, each once
}

func (e *MissingError) Error() string {
	n := len(e.Objects)
	names := make([]string, 0, 3)
	for _, h := range e.Objects[:min(n, 3)] {
		names = append(names, h.String())
	}
	more := ""
	if n > 3 {
		more = fmt.Sprintf(" and %d more", n-3)
	}
	return fmt.Sprintf("tree %s: %d object(s) not in the local store: %s%s", e.Root.Short(), n, strings.Join(names, ", "), more)
}

// Unwrap lets errdefs.IsNotFound match.
func (e *MissingError) Unwrap() error { return errdefs.ErrNotFound }

// node is one entry of a scanned tree.
type node struct {
	name     string
	mode     fs.FileMode
	hash     casstore.Hash
	size     int64
	target   string // symlinks
	owned    bool   // false for the prefix's parent directories
	children []*node
	subdirs  int
}

// Tree is a tree scanned from the store with everything an image needs: every
// directory decoded, every file's size, every symlink's target.
type Tree struct {
	spec  Spec
	top   *node // the image root
	Files int   // regular files
	Dirs  int
	Bytes int64 // total size of the files

	objects []casstore.Hash // the objects files point at, each once
}

// Scan walks spec.Root in store, checking that every object it references is local.
// It is the one place where a tree's objects are checked for local presence: a tree
// with objects missing returns a *MissingError naming all of them (a remote store can
// hydrate exactly those and scan again); a tree that cannot be read at all returns
// another error.
func Scan(ctx context.Context, store *casstore.Store, spec Spec) (*Tree, error) {
	st := newStatter(store)
	defer st.close()
	sc := &scanner{ctx: ctx, store: store, st: st, trees: map[casstore.Hash]casstore.Tree{},
		missing: map[casstore.Hash]struct{}{}, sizes: map[casstore.Hash]int64{}}
	t := &Tree{spec: spec}
	owned := &node{mode: fs.ModeDir | 0o755, hash: spec.Root, owned: true}
	if err := sc.dir(owned, spec.Root, t); err != nil {
		return nil, err
	}
	if len(sc.missing) > 0 {
		e := &MissingError{Root: spec.Root}
		for _, h := range sc.order {
			e.Objects = append(e.Objects, h)
		}
		return nil, e
	}
	t.top = owned
	t.objects = sc.objects
	if spec.Prefix != "" {
		parts := strings.Split(spec.Prefix, "/")
		owned.name = parts[len(parts)-1]
		cur := owned
		for i := len(parts) - 2; i >= -1; i-- {
			p := &node{mode: fs.ModeDir | 0o755, children: []*node{cur}, subdirs: 1}
			if i >= 0 {
				p.name = parts[i]
			}
			cur = p
			t.Dirs++
		}
		t.top = cur
	}
	return t, nil
}

type scanner struct {
	ctx     context.Context
	store   *casstore.Store
	st      *statter
	trees   map[casstore.Hash]casstore.Tree
	missing map[casstore.Hash]struct{}
	order   []casstore.Hash
	sizes   map[casstore.Hash]int64 // objects found, each stat-ed once
	objects []casstore.Hash
	n       int
}

func (sc *scanner) miss(h casstore.Hash) {
	if _, ok := sc.missing[h]; !ok {
		sc.missing[h] = struct{}{}
		sc.order = append(sc.order, h)
	}
}

func (sc *scanner) dir(n *node, h casstore.Hash, t *Tree) error {
	t.Dirs++
	if sc.n++; sc.n%1024 == 0 {
		if err := sc.ctx.Err(); err != nil {
			return err
		}
	}
	tr, ok := sc.trees[h]
	if !ok {
		var err error
		tr, err = sc.store.ReadTree(h)
		if errdefs.IsNotFound(err) {
			sc.miss(h)
			return nil
		}
		if err != nil {
			return fmt.Errorf("read tree %s: %w", h, err)
		}
		sc.trees[h] = tr
	}
	n.children = make([]*node, 0, len(tr))
	for _, e := range tr {
		c := &node{name: e.Name, hash: e.Hash, owned: true}
		switch e.Mode {
		case casstore.ModeDir:
			c.mode = fs.ModeDir | 0o755
			n.subdirs++
			if err := sc.dir(c, e.Hash, t); err != nil {
				return err
			}
		case casstore.ModeSymlink:
			c.mode = fs.ModeSymlink | 0o777
			b, err := sc.store.ReadAll(e.Hash, maxSymlinkTarget)
			if errdefs.IsNotFound(err) {
				sc.miss(e.Hash)
			} else if err != nil {
				return fmt.Errorf("symlink %s: %w", e.Name, err)
			}
			c.target = string(b)
		case casstore.ModeFile, casstore.ModeExec:
			c.mode = 0o644
			if e.Mode == casstore.ModeExec {
				c.mode = 0o755
			}
			t.Files++
			if e.Hash != casstore.EmptyHash {
				size, ok := sc.sizes[e.Hash]
				if !ok {
					var found bool
					var err error
					size, found, err = sc.st.size(e.Hash)
					if err != nil {
						return err
					}
					if found {
						sc.sizes[e.Hash] = size
						sc.objects = append(sc.objects, e.Hash)
					} else {
						sc.miss(e.Hash)
					}
				}
				c.size = size
				t.Bytes += size
			}
		default:
			return fmt.Errorf("tree %s: entry %q has unknown mode %s", h.Short(), e.Name, e.Mode)
		}
		n.children = append(n.children, c)
	}
	return nil
}

// statter learns object sizes with fstatat relative to the fan-out directories,
// which saves most of each path lookup.
type statter struct {
	store *casstore.Store
	dirs  [256]int // fd+1 of each fan-out directory; 0: not opened; -1: absent
}

func newStatter(s *casstore.Store) *statter { return &statter{store: s} }

func (st *statter) close() {
	for i, fd := range st.dirs {
		if fd > 0 {
			unix.Close(fd - 1)
		}
		st.dirs[i] = 0
	}
}

// size returns an object's size; ok is false if the object is not in the store.
func (st *statter) size(h casstore.Hash) (int64, bool, error) {
	x := h.String()
	i := int(h[0])
	if st.dirs[i] == 0 {
		fd, err := unix.Open(path.Join(st.store.Root(), x[:2]), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		switch {
		case err == nil:
			st.dirs[i] = fd + 1
		case errors.Is(err, unix.ENOENT):
			st.dirs[i] = -1
		default:
			return 0, false, fmt.Errorf("object directory %s: %w", x[:2], err)
		}
	}
	if st.dirs[i] < 0 {
		return 0, false, nil
	}
	var s unix.Stat_t
	err := unix.Fstatat(st.dirs[i]-1, x[2:], &s, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("object %s: %w", h, err)
	}
	if s.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, false, fmt.Errorf("object %s is not a regular file: %w", h, errdefs.ErrDataLoss)
	}
	return s.Size, true, nil
}

// WriteImage writes the tree's metadata-only EROFS image to w. The same tree and
// spec always give the same bytes.
func (t *Tree) WriteImage(w io.WriteSeeker) error {
	ew := erofs.Create(w, erofs.WithBuildTime(Mtime, 0))
	if err := ew.CopyFrom(treeFS{t}, erofs.MetadataOnly()); err != nil {
		return fmt.Errorf("build image: %w", err)
	}
	if err := ew.Close(); err != nil {
		return fmt.Errorf("build image: %w", err)
	}
	return nil
}

// Redirect is the overlay redirect of an object: its path relative to the store root.
func Redirect(h casstore.Hash) string {
	x := h.String()
	return "/" + x[:2] + "/" + x[2:]
}

// treeFS presents a scanned Tree as an fs.FS whose FileInfo.Sys is an *erofs.Stat,
// which go-erofs's CopyFrom takes owners, times, link counts and xattrs from.
type treeFS struct{ t *Tree }

var (
	_ fs.ReadDirFS = treeFS{}
	_ fs.StatFS    = treeFS{}
)

func (f treeFS) lookup(op, name string) (*node, error) {
	if !fs.ValidPath(name) {
		return nil, &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
	}
	n := f.t.top
	if name == "." {
		return n, nil
	}
	for _, c := range strings.Split(name, "/") {
		var next *node
		for _, ch := range n.children {
			if ch.name == c {
				next = ch
				break
			}
		}
		if next == nil {
			return nil, &fs.PathError{Op: op, Path: name, Err: fs.ErrNotExist}
		}
		n = next
	}
	return n, nil
}

func (f treeFS) Open(name string) (fs.File, error) {
	n, err := f.lookup("open", name)
	if err != nil {
		return nil, err
	}
	return &nodeFile{info: f.info(n)}, nil
}

func (f treeFS) Stat(name string) (fs.FileInfo, error) {
	n, err := f.lookup("stat", name)
	if err != nil {
		return nil, err
	}
	return f.info(n), nil
}

func (f treeFS) ReadDir(name string) ([]fs.DirEntry, error) {
	n, err := f.lookup("readdir", name)
	if err != nil {
		return nil, err
	}
	out := make([]fs.DirEntry, len(n.children))
	for i, c := range n.children {
		out[i] = fs.FileInfoToDirEntry(f.info(c))
	}
	return out, nil
}

// ReadLink is the interface go-erofs reads symlink targets through.
func (f treeFS) ReadLink(name string) (string, error) {
	n, err := f.lookup("readlink", name)
	if err != nil {
		return "", err
	}
	return n.target, nil
}

func (f treeFS) info(n *node) *nodeInfo {
	st := &erofs.Stat{Mode: n.mode, Mtime: Mtime, Nlink: 1}
	if n.owned {
		st.UID, st.GID = f.t.spec.UID, f.t.spec.GID
	}
	switch {
	case n.mode.IsDir():
		st.Nlink = 2 + n.subdirs
	case n.mode.IsRegular() && n.size > 0:
		st.Size = n.size
		st.Xattrs = map[string]string{xattrMetacopy: "", xattrRedirect: Redirect(n.hash)}
	case n.mode&fs.ModeSymlink != 0:
		st.Size = int64(len(n.target))
	}
	return &nodeInfo{n: n, st: st}
}

type nodeInfo struct {
	n  *node
	st *erofs.Stat
}

func (i *nodeInfo) Name() string       { return i.n.name }
func (i *nodeInfo) Size() int64        { return i.st.Size }
func (i *nodeInfo) Mode() fs.FileMode  { return i.n.mode }
func (i *nodeInfo) ModTime() time.Time { return time.Unix(Mtime, 0) }
func (i *nodeInfo) IsDir() bool        { return i.n.mode.IsDir() }
func (i *nodeInfo) Sys() any           { return i.st }

// nodeFile is what Open returns: stat-only (CopyFrom never reads file data in
// metadata-only mode).
type nodeFile struct{ info *nodeInfo }

func (f *nodeFile) Stat() (fs.FileInfo, error) { return f.info, nil }
func (f *nodeFile) Read([]byte) (int, error) {
	return 0, fmt.Errorf("%s: metadata-only tree has no data: %w", f.info.Name(), fs.ErrInvalid)
}
func (f *nodeFile) Close() error { return nil }

package kview

import (
	"encoding/binary"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/erofs/go-erofs"
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

// WriteImage writes the tree's metadata-only EROFS image to w. The same tree and
// spec always give the same bytes. The image is laid out in memory (go-erofs writes
// directory entries one name at a time) and reaches w in one sequential write.
func (t *Tree) WriteImage(w io.Writer) error {
	m := &memImage{b: make([]byte, 0, t.sizeHint())}
	ew := erofs.Create(m, erofs.WithBuildTime(Mtime, 0))
	if err := ew.CopyFrom(treeFS{t}, erofs.MetadataOnly()); err != nil {
		return fmt.Errorf("build image: %w", err)
	}
	if err := ew.Close(); err != nil {
		return fmt.Errorf("build image: %w", err)
	}
	if _, err := w.Write(m.b); err != nil {
		return fmt.Errorf("write image: %w", err)
	}
	return nil
}

// sizeHint guesses the image size (about 240 bytes per entry in practice).
func (t *Tree) sizeHint() int { return 4096 + 256*(t.Files+t.Dirs) }

// memImage is an in-memory io.WriteSeeker.
type memImage struct {
	b   []byte
	off int
}

func (m *memImage) Write(p []byte) (int, error) {
	if end := m.off + len(p); end > len(m.b) {
		m.b = append(m.b, make([]byte, end-len(m.b))...)
	}
	copy(m.b[m.off:], p)
	m.off += len(p)
	return len(p), nil
}

func (m *memImage) Seek(off int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
	case io.SeekCurrent:
		off += int64(m.off)
	case io.SeekEnd:
		off += int64(len(m.b))
	default:
		return 0, fmt.Errorf("seek: bad whence %d", whence)
	}
	if off < 0 || off > 1<<40 {
		return 0, fmt.Errorf("seek to %d: out of range", off)
	}
	m.off = int(off)
	return off, nil
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
	if n, ok := f.t.dirs[name]; ok {
		return n, nil
	}
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	if p, ok := f.t.dirs[dir]; ok {
		for _, c := range p.children {
			if c.name == base {
				return c, nil
			}
		}
	}
	return nil, &fs.PathError{Op: op, Path: name, Err: fs.ErrNotExist}
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
		out[i] = f.info(c)
	}
	return out, nil
}

// ReadLink is the interface go-erofs reads symlink targets through.
func (f treeFS) ReadLink(name string) (string, error) {
	if target, ok := f.t.links[name]; ok {
		return target, nil
	}
	n, err := f.lookup("readlink", name)
	if err != nil {
		return "", err
	}
	return n.target, nil
}

func (f treeFS) info(n *node) *nodeInfo {
	i := &nodeInfo{n: n, st: erofs.Stat{Mode: n.mode, Mtime: Mtime, Nlink: 1}}
	st := &i.st
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
	return i
}

type nodeInfo struct {
	n  *node
	st erofs.Stat
}

func (i *nodeInfo) Name() string       { return i.n.name }
func (i *nodeInfo) Size() int64        { return i.st.Size }
func (i *nodeInfo) Mode() fs.FileMode  { return i.n.mode }
func (i *nodeInfo) ModTime() time.Time { return time.Unix(Mtime, 0) }
func (i *nodeInfo) IsDir() bool        { return i.n.mode.IsDir() }
func (i *nodeInfo) Sys() any           { return &i.st }

// A nodeInfo is its own fs.DirEntry, which saves ReadDir a wrapper per entry.
func (i *nodeInfo) Type() fs.FileMode          { return i.n.mode.Type() }
func (i *nodeInfo) Info() (fs.FileInfo, error) { return i, nil }

// nodeFile is what Open returns: stat-only (CopyFrom never reads file data in
// metadata-only mode).
type nodeFile struct{ info *nodeInfo }

func (f *nodeFile) Stat() (fs.FileInfo, error) { return f.info, nil }
func (f *nodeFile) Read([]byte) (int, error) {
	return 0, fmt.Errorf("%s: metadata-only tree has no data: %w", f.info.Name(), fs.ErrInvalid)
}
func (f *nodeFile) Close() error { return nil }

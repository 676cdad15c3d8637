package kview

import (
	"encoding/binary"
	"fmt"
	"io"
	"io/fs"
	"strings"

	"github.com/containerd/errdefs"
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
	xattrMetacopy = xattrTrusted + xattrMetacopySuffix
	xattrRedirect = xattrTrusted + xattrRedirectSuffix
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

// Redirect is the overlay redirect of an object: its path relative to the store root.
func Redirect(h casstore.Hash) string {
	x := h.String()
	return "/" + x[:2] + "/" + x[2:]
}

// Package imagebuild builds the small OCI images the real-stack tests run,
// without docker or a registry: an image is a list of layers, a layer a list of
// entries (files, directories, symlinks, copies of host files and trees). Build
// writes an OCI image layout archive that `ctr images import` accepts; Cached
// keeps archives under <repo>/.cache/images. Ready-made: Busybox, Node, Pause.
//
// Only laying a layer out on disk is ours; containerd's own code writes the
// layer tars (archive.WriteDiff, as for a snapshot), holds the blobs (a local
// content store) and writes the archive (images/archive.Export, as `ctr images
// export`). We chose it over go-containerregistry: it is already a dependency,
// its importer reads these archives in every test, and go-containerregistry
// writes an OCI layout only as a directory (google/go-containerregistry#1879).
// Output is deterministic (fixed mtimes, root ownership unless asked, sorted
// entries, no host metadata): one Spec always gives one manifest digest.
package imagebuild

import (
	"io/fs"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Kind says what an Entry puts into a layer.
type Kind int

// Entry kinds.
const (
	KindFile    Kind = iota + 1 // a regular file holding Entry.Data
	KindDir                     // a directory
	KindSymlink                 // a symbolic link to Entry.Target
	KindHost                    // a copy of the host file or tree Entry.Source
)

// Entry is one thing a layer holds at an absolute path inside the image.
// Build it with File, Dir, Symlink or HostFile, and Owner.
type Entry struct {
	Path string
	Kind Kind
	Data []byte // content of a KindFile
	// Target is the link target of a KindSymlink, stored as given.
	Target string
	// Source is the host path a KindHost copies (or, within a copy, a file's).
	Source string
	// Mode holds the permission bits plus fs.ModeSetuid, fs.ModeSetgid and
	// fs.ModeSticky of a KindFile or KindDir; host copies keep the host's.
	Mode fs.FileMode
	// UID and GID own the entry (for a KindHost, everything it copies).
	UID, GID int
}

// File is a regular file holding data.
func File(p string, data []byte, mode fs.FileMode) Entry {
	return Entry{Path: p, Kind: KindFile, Data: data, Mode: mode}
}

// Dir is a directory.
func Dir(p string, mode fs.FileMode) Entry { return Entry{Path: p, Kind: KindDir, Mode: mode} }

// Symlink is a symbolic link at p pointing to target.
func Symlink(p, target string) Entry { return Entry{Path: p, Kind: KindSymlink, Target: target} }

// HostFile copies the host file src to p, following symlinks; if src is a
// directory, it copies the whole tree, keeping the symlinks inside it.
func HostFile(p, src string) Entry { return Entry{Path: p, Kind: KindHost, Source: src} }

// Owner returns a copy of e owned by uid:gid.
func (e Entry) Owner(uid, gid int) Entry {
	e.UID, e.GID = uid, gid
	return e
}

// Layer is one filesystem layer: entries in any order; a path may appear only
// once. A parent directory the layer does not list is added as 0755 root:root,
// whatever a lower layer made it: list it to keep a lower layer's mode.
type Layer []Entry

// Spec describes an image: its layers, bottom first, and its config.
type Spec struct {
	Layers []Layer
	// Config is the runtime config; Env defaults to DefaultPath, WorkingDir to "/".
	Config ocispec.ImageConfig
}

// DefaultPath is the PATH an image gets when its Config.Env is empty.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

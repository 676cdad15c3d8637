// Package imagebuild builds small OCI images in Go, without docker or a
// registry, for the real-stack tests: an image is a list of layers, a layer a
// list of entries (files, directories, symlinks, whiteouts, copies of host files
// and host directory trees). Build writes an OCI image layout archive that
// `ctr images import` accepts; Cached keeps archives under <repo>/.cache/images.
//
// Only the layer tars are ours (archive/tar: the entries, their implied parent
// directories, fixed mtimes and owners). Blobs, config, manifest and the layout
// archive are containerd's own code: content.WriteBlob into a local content
// store, archive/compression for gzip, and images/archive.Export, the code behind
// `ctr images export`. We chose containerd over go-containerregistry: it is
// already a dependency, its importer reads these archives back in every test, and
// go-containerregistry writes an OCI layout only as a directory (a tar is its
// docker format, google/go-containerregistry#1879), so a tar step would stay ours.
//
// Output is deterministic (fixed mtimes, root ownership unless asked, sorted
// entries, no host metadata), so one Spec always gives one manifest digest.
// Ready-made specs: Busybox, Node and Pause (images.go).
package imagebuild

import (
	"fmt"
	"io/fs"
	"path"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Kind says what an Entry puts into a layer.
type Kind int

// Entry kinds.
const (
	KindFile     Kind = iota + 1 // a regular file holding Entry.Data
	KindDir                      // a directory
	KindSymlink                  // a symbolic link to Entry.Target
	KindHostFile                 // a copy of the host file Entry.Source (symlinks followed)
	KindHostDir                  // a copy of the host tree Entry.Source, host permissions, links kept
	KindWhiteout                 // an OCI ".wh." file deleting Entry.Path from the layers below
)

// Entry is one thing a layer contains at an absolute path inside the image.
// Build it with File, Dir, Symlink, HostFile, HostDir or Whiteout, and Owner.
type Entry struct {
	Path string
	Kind Kind
	Data []byte // content of a KindFile
	// Target is the link target of a KindSymlink, stored as given.
	Target string
	// Source is the host path a KindHostFile or KindHostDir copies.
	Source string
	// Mode holds the permission bits plus fs.ModeSetuid, fs.ModeSetgid and
	// fs.ModeSticky. Zero means 0644 for files, 0755 for directories and the
	// host's permissions for host copies (a KindHostDir always keeps them).
	Mode fs.FileMode
	// UID and GID own the entry (for a KindHostDir, every entry it copies).
	UID, GID int
}

// File is a regular file holding data.
func File(p string, data []byte, mode fs.FileMode) Entry {
	return Entry{Path: p, Kind: KindFile, Data: data, Mode: mode}
}

// Dir is a directory.
func Dir(p string, mode fs.FileMode) Entry { return Entry{Path: p, Kind: KindDir, Mode: mode} }

// Symlink is a symbolic link at p pointing to target.
func Symlink(p, target string) Entry {
	return Entry{Path: p, Kind: KindSymlink, Target: target, Mode: 0o777}
}

// HostFile copies the host file src (following symlinks) to p with its permissions.
func HostFile(p, src string) Entry { return Entry{Path: p, Kind: KindHostFile, Source: src} }

// HostDir copies the host directory tree src to p.
func HostDir(p, src string) Entry { return Entry{Path: p, Kind: KindHostDir, Source: src} }

// Whiteout removes p (and everything below it) from the layers underneath.
func Whiteout(p string) Entry { return Entry{Path: p, Kind: KindWhiteout} }

// Owner returns a copy of e owned by uid:gid.
func (e Entry) Owner(uid, gid int) Entry {
	e.UID, e.GID = uid, gid
	return e
}

// Layer is one filesystem layer: entries in any order. Missing parent
// directories are added (0755, root, or as a lower layer declared them); a path
// may appear only once.
type Layer []Entry

// Spec describes an image: its layers, bottom first, and its config.
type Spec struct {
	Layers []Layer
	// Config is the runtime config; Env defaults to DefaultPath, WorkingDir to "/".
	Config ocispec.ImageConfig
	// Gzip compresses the layers (application/vnd.oci.image.layer.v1.tar+gzip).
	Gzip bool
	// Arch is the image architecture; empty means the host's (runtime.GOARCH).
	Arch string
}

// DefaultPath is the PATH an image gets when its Config.Env is empty.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// cleanPath validates an in-image path and returns it clean, without the
// leading slash (the form tar names take). Cleaning an absolute path cannot
// climb above the root.
func cleanPath(p string) (string, error) {
	if !strings.HasPrefix(p, "/") || strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("image path %q is not absolute or contains NUL", p)
	}
	if c := strings.TrimPrefix(path.Clean(p), "/"); c != "" {
		return c, nil
	}
	return "", fmt.Errorf("image path %q is the root directory", p)
}

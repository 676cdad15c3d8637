// Package imagebuild builds small OCI images in Go, without docker or a
// registry, for the real-stack tests: an image is a list of layers, a layer a
// list of entries (files, directories, symlinks, whiteouts, copies of host files
// and host directories). Build writes an OCI image layout archive (oci-layout,
// index.json, blobs/sha256/...) that `ctr images import` accepts.
//
// Output is deterministic (fixed mtimes, root ownership unless asked, sorted
// entries, no host metadata), so the same Spec always gives the same manifest
// digest, and Cached can keep built archives under <repo>/.cache/images keyed by
// a hash of the spec. Layers are uncompressed tars
// (application/vnd.oci.image.layer.v1.tar) unless Spec.Gzip is set.
//
// Ready-made specs: Busybox (busybox-static with applet symlinks, an "agent"
// user), Node (Busybox plus the host's node, its shared libraries and a real
// npm dependency tree in /app) and Pause (a static holder process for CRI).
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
	// KindFile is a regular file with the bytes in Entry.Data.
	KindFile Kind = iota + 1
	// KindDir is a directory.
	KindDir
	// KindSymlink is a symbolic link to Entry.Target.
	KindSymlink
	// KindHostFile copies the host file Entry.Source (symlinks followed).
	KindHostFile
	// KindHostDir copies the host directory tree Entry.Source: directories,
	// regular files and symlinks (kept as links), with their host permissions.
	KindHostDir
	// KindWhiteout deletes Entry.Path from the layers below (an OCI ".wh." file).
	KindWhiteout
)

func (k Kind) String() string {
	switch k {
	case KindFile:
		return "file"
	case KindDir:
		return "dir"
	case KindSymlink:
		return "symlink"
	case KindHostFile:
		return "host file"
	case KindHostDir:
		return "host dir"
	case KindWhiteout:
		return "whiteout"
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// Entry is one thing a layer contains at an absolute path inside the image.
// Build it with File, Dir, Symlink, HostFile, HostDir or Whiteout, and Owner.
type Entry struct {
	Path string
	Kind Kind
	// Data is the content of a KindFile.
	Data []byte
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
func Dir(p string, mode fs.FileMode) Entry {
	return Entry{Path: p, Kind: KindDir, Mode: mode}
}

// Symlink is a symbolic link at p pointing to target.
func Symlink(p, target string) Entry {
	return Entry{Path: p, Kind: KindSymlink, Target: target, Mode: 0o777}
}

// HostFile copies the host file src (following symlinks) to p with the host's
// permissions.
func HostFile(p, src string) Entry {
	return Entry{Path: p, Kind: KindHostFile, Source: src}
}

// HostDir copies the host directory tree src to p.
func HostDir(p, src string) Entry {
	return Entry{Path: p, Kind: KindHostDir, Source: src}
}

// Whiteout removes p (and everything below it) from the layers underneath.
func Whiteout(p string) Entry {
	return Entry{Path: p, Kind: KindWhiteout}
}

// Owner returns a copy of e owned by uid:gid.
func (e Entry) Owner(uid, gid int) Entry {
	e.UID, e.GID = uid, gid
	return e
}

// Layer is one filesystem layer: entries in any order. Missing parent
// directories are added (0755, root); a path may appear only once.
type Layer []Entry

// Config is the runtime part of the image config.
type Config struct {
	Entrypoint []string
	Cmd        []string
	// Env defaults to a standard PATH when empty.
	Env []string
	// WorkingDir defaults to "/".
	WorkingDir string
	User       string
	Labels     map[string]string
}

// Spec describes an image: its layers, bottom first, and its config.
type Spec struct {
	Layers []Layer
	Config Config
	// Gzip compresses the layers (application/vnd.oci.image.layer.v1.tar+gzip).
	Gzip bool
	// Arch is the image architecture; empty means the host's (runtime.GOARCH).
	Arch string
}

// DefaultPath is the PATH an image gets when its Config.Env is empty.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// imageConfig fills in the defaults of c.
func (c Config) imageConfig() ocispec.ImageConfig {
	env := c.Env
	if len(env) == 0 {
		env = []string{DefaultPath}
	}
	wd := c.WorkingDir
	if wd == "" {
		wd = "/"
	}
	return ocispec.ImageConfig{
		User:       c.User,
		Env:        env,
		Entrypoint: c.Entrypoint,
		Cmd:        c.Cmd,
		WorkingDir: wd,
		Labels:     c.Labels,
	}
}

// cleanPath validates an in-image path and returns it clean, without the
// leading slash (the form tar names take). Paths must be absolute; cleaning an
// absolute path cannot climb above the root.
func cleanPath(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("image path %q is not absolute", p)
	}
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("image path %q contains NUL", p)
	}
	c := strings.TrimPrefix(path.Clean(p), "/")
	if c == "" {
		return "", fmt.Errorf("image path %q is the root directory", p)
	}
	return c, nil
}

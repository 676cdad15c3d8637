package imagebuild

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive"
	continuityfs "github.com/containerd/continuity/fs"
)

// epoch is the modification time of every entry, so builds are reproducible.
var epoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// writeLayer lays the entries of l out in a temporary directory and has
// containerd's archive.WriteDiff write the tar of that tree to w, every mtime
// clamped to epoch. Owners other than the caller's need root.
func writeLayer(ctx context.Context, w io.Writer, l Layer) error {
	tmp, err := os.MkdirTemp("", "imagebuild-layer-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	empty, tree := filepath.Join(tmp, "empty"), filepath.Join(tmp, "tree")
	implied := Dir("", 0o755)
	if err := errors.Join(os.Mkdir(empty, 0o755), implied.place(tree, true)); err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, e := range l {
		// Cleaning an absolute path cannot climb above the root.
		name := path.Clean(e.Path)
		if !path.IsAbs(e.Path) || name == "/" || seen[name] {
			return fmt.Errorf("%s: not an absolute path, the root, or listed twice", e.Path)
		}
		seen[name] = true
		dir := tree
		for _, c := range strings.Split(path.Dir(name), "/") { // the parents, top down
			dir = filepath.Join(dir, c)
			if err := implied.place(dir, true); err != nil {
				return fmt.Errorf("%s: %w", e.Path, err)
			}
		}
		if err := e.place(filepath.Join(tree, name), false); err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
	}
	return archive.WriteDiff(ctx, w, empty, tree, archive.WithSourceDateEpoch(&epoch))
}

// place creates e at p, whose parent exists. An implied directory that exists
// is left alone (an existing symlink or file there is an error); an explicit
// one takes over an implied one.
func (e Entry) place(p string, implied bool) error {
	switch e.Kind {
	case KindDir:
		err := os.Mkdir(p, 0o700)
		if fi, serr := os.Lstat(p); errors.Is(err, fs.ErrExist) && serr == nil && fi.IsDir() {
			if implied {
				return nil
			}
			err = nil
		}
		return errors.Join(err, own(p, e.UID, e.GID, e.Mode))
	case KindFile:
		if e.Source != "" { // a file of a host copy
			return errors.Join(continuityfs.CopyFile(p, e.Source), own(p, e.UID, e.GID, e.Mode))
		}
		return errors.Join(os.WriteFile(p, e.Data, 0o600), own(p, e.UID, e.GID, e.Mode))
	case KindSymlink:
		return errors.Join(os.Symlink(e.Target, p), own(p, e.UID, e.GID, fs.ModeSymlink))
	case KindHost: // each file, directory and symlink as an explicit entry
		return walkHost(e.Source, func(s, rel string, fi fs.FileInfo) error {
			c := Entry{Kind: KindDir, Mode: fi.Mode(), UID: e.UID, GID: e.GID}
			var err error
			switch fi.Mode().Type() {
			case 0:
				c.Kind, c.Source = KindFile, s
			case fs.ModeSymlink:
				c.Kind = KindSymlink
				c.Target, err = os.Readlink(s)
			case fs.ModeDir:
			default:
				return fmt.Errorf("%s: unsupported file type %v", s, fi.Mode().Type())
			}
			return errors.Join(err, c.place(filepath.Join(p, rel), false))
		})
	}
	return fmt.Errorf("unknown entry kind %d", e.Kind)
}

// walkHost calls fn for the host path src (symlinks to it followed) and, if it
// is a directory, for everything below it, parents first, with each path also
// given relative to src ("." for src itself).
func walkHost(src string, fn func(s, rel string, fi fs.FileInfo) error) error {
	src, err := filepath.EvalSymlinks(src)
	if err != nil {
		return err
	}
	return filepath.Walk(src, func(s string, fi fs.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, s) // s is below src
		return fn(s, rel, fi)
	})
}

// own gives p its owner, then its mode: permissions and setuid, setgid and
// sticky bits (in that order: chown clears setuid).
func own(p string, uid, gid int, mode fs.FileMode) error {
	if err := os.Lchown(p, uid, gid); err != nil || mode&fs.ModeSymlink != 0 {
		return err
	}
	return os.Chmod(p, mode&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky))
}

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
	implied := Entry{Kind: KindDir}
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
		var err error
		dir := tree
		for _, c := range strings.Split(path.Dir(name), "/") { // the parents, top down
			if dir = filepath.Join(dir, c); err == nil {
				err = implied.place(dir, true)
			}
		}
		if err == nil {
			err = e.place(filepath.Join(tree, name), false)
		}
		if err != nil {
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
		return errors.Join(err, own(p, e.UID, e.GID, e.Mode, 0o755))
	case KindFile:
		return errors.Join(os.WriteFile(p, e.Data, 0o600), own(p, e.UID, e.GID, e.Mode, 0o644))
	case KindSymlink:
		if e.Target == "" {
			return errors.New("symlink has no target")
		}
		return errors.Join(os.Symlink(e.Target, p), own(p, e.UID, e.GID, fs.ModeSymlink, 0))
	case KindHost:
		return walkHost(e.Source, func(s, rel string, fi fs.FileInfo) error {
			dst := filepath.Join(p, rel)
			var err error
			switch fi.Mode().Type() {
			case fs.ModeDir:
				err = os.Mkdir(dst, 0o700)
				if rel == "." && errors.Is(err, fs.ErrExist) { // p was an implied parent
					err = nil
				}
			case 0:
				err = copyFile(dst, s)
			case fs.ModeSymlink:
				var target string
				if target, err = os.Readlink(s); err == nil {
					err = os.Symlink(target, dst)
				}
			default:
				err = fmt.Errorf("%s: unsupported file type %v", s, fi.Mode().Type())
			}
			return errors.Join(err, own(dst, e.UID, e.GID, fi.Mode(), 0))
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
	return filepath.WalkDir(src, func(s string, d fs.DirEntry, err error) error {
		var fi fs.FileInfo
		if err == nil {
			fi, err = d.Info()
		}
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, s) // s is below src
		return fn(s, rel, fi)
	})
}

// own gives p its owner, then its mode (or def when mode has no permission
// bits): permissions and setuid, setgid and sticky bits; chown clears setuid.
func own(p string, uid, gid int, mode, def fs.FileMode) error {
	if err := os.Lchown(p, uid, gid); err != nil || mode&fs.ModeSymlink != 0 {
		return err
	}
	if mode.Perm() == 0 {
		mode = def
	}
	return os.Chmod(p, mode&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky))
}

func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

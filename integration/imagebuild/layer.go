package imagebuild

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive"
)

// Epoch is the modification time of every entry, so builds are reproducible.
var Epoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// writeLayer lays the entries of l out in a temporary directory and has
// containerd's archive.WriteDiff (the code that turns a snapshot into a layer)
// write the tar to w, every mtime clamped to Epoch. dirs holds the directories
// lower layers declared, so that an implied parent keeps their mode and owner
// (adding /tmp/x must not turn a 1777 /tmp into 0755); it gains this layer's
// and loses what this layer replaces or whites out.
// Owners other than the caller's need root.
func writeLayer(ctx context.Context, w io.Writer, l Layer, dirs map[string]Entry) error {
	tmp, err := os.MkdirTemp("", "imagebuild-layer-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	empty, tree := filepath.Join(tmp, "empty"), filepath.Join(tmp, "tree")
	if err := os.Mkdir(empty, 0o755); err != nil {
		return err
	}
	seen, below := map[string]bool{}, maps.Clone(dirs)
	for _, e := range l {
		name, err := cleanPath(e.Path)
		if err == nil && seen[name] {
			err = fmt.Errorf("/%s appears twice in one layer", name)
		}
		seen[name] = true
		for i := range len(name) + 1 { // the tree, then each parent of name
			if err == nil && (i == 0 || name[i-1] == '/') && i < len(name) {
				parent, ok := below[strings.TrimSuffix(name[:i], "/")]
				if !ok {
					parent = Entry{Kind: KindDir, Mode: 0o755}
				}
				err = parent.place(filepath.Join(tree, name[:i]), true)
			}
		}
		if err = errors.Join(err, e.place(filepath.Join(tree, name), false)); err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		if e.Kind == KindDir {
			dirs[name] = e
			continue
		}
		for d := range dirs { // what this entry replaces or whites out is gone
			if d == name || strings.HasPrefix(d, name+"/") {
				delete(dirs, d)
			}
		}
	}
	return archive.WriteDiff(ctx, w, empty, tree, archive.WithSourceDateEpoch(&Epoch))
}

// place creates e at p (whose parent exists). An implied directory that exists
// is left alone; an explicit one takes over the implied one.
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
	case KindWhiteout:
		return os.WriteFile(path.Join(path.Dir(p), ".wh."+path.Base(p)), nil, 0o600)
	case KindHostFile:
		fi, err := os.Stat(e.Source)
		if err == nil && !fi.Mode().IsRegular() {
			err = fmt.Errorf("host file %s is not a regular file", e.Source)
		}
		if err != nil {
			return err
		}
		return errors.Join(copyFile(p, e.Source), own(p, e.UID, e.GID, e.Mode, fi.Mode()))
	case KindHostDir:
		src, err := filepath.EvalSymlinks(e.Source)
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
			rel, _ := filepath.Rel(src, s)
			dst := filepath.Join(p, rel)
			switch fi.Mode().Type() {
			case fs.ModeDir:
				err = os.Mkdir(dst, 0o700)
				if s == src && errors.Is(err, fs.ErrExist) { // p was an implied parent
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

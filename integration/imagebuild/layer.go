package imagebuild

import (
	"archive/tar"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// Epoch is the modification time of every entry, so builds are reproducible.
var Epoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// node is one tar entry of a layer after expansion.
type node struct {
	name     string // clean, relative ("bin/sh")
	typ      byte   // tar.TypeReg, TypeDir, TypeSymlink
	mode     fs.FileMode
	uid, gid int
	data     []byte // TypeReg content, unless src is set
	src      string // host file to copy for TypeReg
	size     int64
	target   string
	implicit bool // a parent directory nobody asked for
}

// expand turns a layer's entries into a sorted list of tar entries, adding
// missing parent directories and refusing duplicate or conflicting paths. A
// parent directory that a lower layer declared (below) is repeated with that
// layer's mode and owner, so adding /tmp/x never turns a 1777 /tmp into 0755.
func expand(l Layer, below map[string]*node) ([]*node, error) {
	nodes := map[string]*node{}
	add := func(n *node) error {
		if old, ok := nodes[n.name]; ok {
			switch {
			case old.implicit && n.typ == tar.TypeDir:
				// an explicit directory replaces the implied one
			case n.implicit && old.typ == tar.TypeDir:
				return nil
			case n.implicit:
				return fmt.Errorf("/%s is a %s but entries are placed below it", n.name, typeName(old.typ))
			default:
				return fmt.Errorf("/%s appears twice in one layer", n.name)
			}
		}
		nodes[n.name] = n
		return nil
	}
	addParents := func(name string) error {
		for dir := path.Dir(name); dir != "."; dir = path.Dir(dir) {
			parent := &node{name: dir, typ: tar.TypeDir, mode: 0o755, implicit: true}
			if d, ok := below[dir]; ok {
				parent.mode, parent.uid, parent.gid = d.mode, d.uid, d.gid
			}
			if err := add(parent); err != nil {
				return err
			}
		}
		return nil
	}
	for _, e := range l {
		name, err := cleanPath(e.Path)
		if err != nil {
			return nil, err
		}
		ns, err := entryNodes(e, name)
		if err != nil {
			return nil, err
		}
		for _, n := range ns {
			if err := addParents(n.name); err != nil {
				return nil, err
			}
			if err := add(n); err != nil {
				return nil, err
			}
		}
	}
	out := make([]*node, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, n)
	}
	// Plain string order puts every directory before its contents (a prefix
	// sorts first), which is the order extractors expect.
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, nil
}

func typeName(t byte) string {
	switch t {
	case tar.TypeDir:
		return "directory"
	case tar.TypeSymlink:
		return "symlink"
	}
	return "file"
}

// entryNodes expands one entry (a host directory becomes many nodes).
func entryNodes(e Entry, name string) ([]*node, error) {
	switch e.Kind {
	case KindFile:
		return []*node{{name: name, typ: tar.TypeReg, mode: modeOr(e.Mode, 0o644), uid: e.UID, gid: e.GID, data: e.Data, size: int64(len(e.Data))}}, nil
	case KindDir:
		return []*node{{name: name, typ: tar.TypeDir, mode: modeOr(e.Mode, 0o755), uid: e.UID, gid: e.GID}}, nil
	case KindSymlink:
		if e.Target == "" {
			return nil, fmt.Errorf("symlink %s has no target", e.Path)
		}
		return []*node{{name: name, typ: tar.TypeSymlink, mode: 0o777, uid: e.UID, gid: e.GID, target: e.Target}}, nil
	case KindWhiteout:
		wh := path.Join(path.Dir(name), ".wh."+path.Base(name))
		return []*node{{name: wh, typ: tar.TypeReg, mode: 0o600}}, nil
	case KindHostFile:
		fi, err := os.Stat(e.Source)
		if err != nil {
			return nil, fmt.Errorf("host file for %s: %w", e.Path, err)
		}
		if !fi.Mode().IsRegular() {
			return nil, fmt.Errorf("host file %s for %s is not a regular file", e.Source, e.Path)
		}
		return []*node{{name: name, typ: tar.TypeReg, mode: modeOr(e.Mode, hostMode(fi.Mode())), uid: e.UID, gid: e.GID, src: e.Source, size: fi.Size()}}, nil
	case KindHostDir:
		return hostDirNodes(e, name)
	}
	return nil, fmt.Errorf("entry %s: unknown kind %v", e.Path, e.Kind)
}

// hostDirNodes walks a host directory in lexical order. Symlinks inside it are
// copied as links; a symlink as the source itself is followed.
func hostDirNodes(e Entry, name string) ([]*node, error) {
	src, err := filepath.EvalSymlinks(e.Source)
	if err != nil {
		return nil, fmt.Errorf("host dir for %s: %w", e.Path, err)
	}
	var out []*node
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		n := &node{name: path.Join(name, filepath.ToSlash(rel)), uid: e.UID, gid: e.GID}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case fi.IsDir():
			n.typ, n.mode = tar.TypeDir, hostMode(fi.Mode())
		case fi.Mode().IsRegular():
			n.typ, n.mode, n.src, n.size = tar.TypeReg, hostMode(fi.Mode()), p, fi.Size()
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			n.typ, n.mode, n.target = tar.TypeSymlink, 0o777, target
		default:
			return fmt.Errorf("%s: unsupported file type %v", p, fi.Mode().Type())
		}
		out = append(out, n)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("host dir %s for %s: %w", e.Source, e.Path, err)
	}
	return out, nil
}

func modeOr(m, def fs.FileMode) fs.FileMode {
	if m == 0 {
		return def
	}
	return m
}

// hostMode keeps the bits an image may carry from a host file mode.
func hostMode(m fs.FileMode) fs.FileMode {
	return m & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
}

// tarMode converts permission and special bits to the tar (Unix) encoding.
func tarMode(m fs.FileMode) int64 {
	v := int64(m.Perm())
	if m&fs.ModeSetuid != 0 {
		v |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		v |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		v |= 0o1000
	}
	return v
}

// writeLayer writes the tar stream of a layer to w. dirs holds the
// directories of the layers below and gains this layer's.
func writeLayer(w io.Writer, l Layer, dirs map[string]*node) error {
	nodes, err := expand(l, dirs)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		switch base := path.Base(n.name); {
		case n.typ == tar.TypeDir:
			dirs[n.name] = n
		case strings.HasPrefix(base, ".wh."):
			forget(dirs, path.Join(path.Dir(n.name), strings.TrimPrefix(base, ".wh.")))
		default:
			forget(dirs, n.name)
		}
	}
	tw := tar.NewWriter(w)
	for _, n := range nodes {
		hdr := &tar.Header{
			Typeflag: n.typ,
			Name:     n.name,
			Mode:     tarMode(n.mode),
			Uid:      n.uid,
			Gid:      n.gid,
			ModTime:  Epoch,
			Format:   tar.FormatPAX,
		}
		switch n.typ {
		case tar.TypeDir:
			hdr.Name += "/"
		case tar.TypeSymlink:
			hdr.Linkname = n.target
		case tar.TypeReg:
			hdr.Size = n.size
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("write /%s: %w", n.name, err)
		}
		if n.typ != tar.TypeReg {
			continue
		}
		if err := writeContent(tw, n); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("finish layer: %w", err)
	}
	return nil
}

// forget drops name and everything below it from dirs.
func forget(dirs map[string]*node, name string) {
	for d := range dirs {
		if d == name || strings.HasPrefix(d, name+"/") {
			delete(dirs, d)
		}
	}
}

func writeContent(w io.Writer, n *node) error {
	if n.src == "" {
		if _, err := w.Write(n.data); err != nil {
			return fmt.Errorf("write /%s: %w", n.name, err)
		}
		return nil
	}
	f, err := os.Open(n.src)
	if err != nil {
		return fmt.Errorf("copy %s to /%s: %w", n.src, n.name, err)
	}
	defer f.Close()
	// The size went into the header already: a host file that changed length
	// since it was examined must fail the build, not corrupt the layer.
	copied, err := io.Copy(w, io.LimitReader(f, n.size+1))
	if err == nil && copied != n.size {
		err = fmt.Errorf("size changed from %d to %d bytes while building", n.size, copied)
	}
	if err != nil {
		return fmt.Errorf("copy %s to /%s: %w", n.src, n.name, err)
	}
	return nil
}

package kview

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"path"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/erofs/go-erofs"

	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// goErofsImage is the image go-erofs writes for t: the reference the image writer
// (erofs.go) must match byte for byte.
func goErofsImage(t *Tree) ([]byte, error) {
	m := &memImage{}
	ew := erofs.Create(m, erofs.WithBuildTime(Mtime, 0))
	if err := ew.CopyFrom(newTreeFS(t), erofs.MetadataOnly()); err != nil {
		return nil, fmt.Errorf("build image: %w", err)
	}
	if err := ew.Close(); err != nil {
		return nil, fmt.Errorf("build image: %w", err)
	}
	return m.b, nil
}

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
	m.off = int(off)
	return off, nil
}

// treeFS presents a scanned Tree as an fs.FS whose FileInfo.Sys is an *erofs.Stat,
// which go-erofs's CopyFrom takes owners, times, link counts and xattrs from.
type treeFS struct {
	t     *Tree
	dirs  map[string]*node  // every directory by its path in the image ("." for the top)
	links map[string]string // every symlink's target by its path in the image
}

func newTreeFS(t *Tree) treeFS {
	f := treeFS{t: t, dirs: map[string]*node{}, links: map[string]string{}}
	var walk func(n *node, p string)
	walk = func(n *node, p string) {
		f.dirs[p] = n
		for _, c := range n.children {
			cp := c.name
			if p != "." {
				cp = p + "/" + c.name
			}
			switch {
			case c.mode.IsDir():
				walk(c, cp)
			case c.mode&fs.ModeSymlink != 0:
				f.links[cp] = c.target
			}
		}
	}
	walk(t.top, ".")
	return f
}

var (
	_ fs.ReadDirFS = treeFS{}
	_ fs.StatFS    = treeFS{}
)

func (f treeFS) lookup(op, name string) (*node, error) {
	if !fs.ValidPath(name) {
		return nil, &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
	}
	if n, ok := f.dirs[name]; ok {
		return n, nil
	}
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	if p, ok := f.dirs[dir]; ok {
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
	if target, ok := f.links[name]; ok {
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

// TestImageMatchesGoErofs: the image writer lays out exactly what go-erofs writes for
// the same tree, for the fixture under several specs and for random trees that reach
// every layout rule (directories spilling over several blocks or out of their
// inode's block, long and short symlinks, empty and huge files, names sorting before
// ".", owners that need extended inodes).
func TestImageMatchesGoErofs(t *testing.T) {
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	for _, spec := range []Spec{
		{Root: root},
		{Root: root, Prefix: "srv/app", UID: 1000, GID: 1001},
		{Root: root, Prefix: "a", UID: 70000, GID: 5},
	} {
		tr, err := Scan(context.Background(), s, spec)
		if err != nil {
			t.Fatal(err)
		}
		compareWithGoErofs(t, tr, fmt.Sprintf("fixture %+v", spec))
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 60 {
		tr := randomTree(rng, i)
		compareWithGoErofs(t, tr, fmt.Sprintf("random tree %d", i))
	}
}

func compareWithGoErofs(t *testing.T, tr *Tree, what string) {
	t.Helper()
	want, err := goErofsImage(tr)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.imageBytes()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		n := min(len(got), len(want))
		at := n
		for i := range n {
			if got[i] != want[i] {
				at = i
				break
			}
		}
		t.Fatalf("%s: image differs from go-erofs's: %d bytes against %d, first difference at byte %d", what, len(got), len(want), at)
	}
}

// randomTree makes a tree of nodes directly (no store): sizes, names and shapes
// chosen to hit the writer's edge cases.
func randomTree(rng *rand.Rand, seed int) *Tree {
	t := &Tree{spec: Spec{UID: uint32(rng.IntN(3)) * 40000, GID: uint32(rng.IntN(2)) * 70000}}
	if seed%7 == 0 {
		t.spec.UID, t.spec.GID = 0, 0
	}
	alphabet := "-+!#.abcXYZ_0189~é"
	name := func(maxLen int) string {
		r := []rune(alphabet)
		n := 1 + rng.IntN(maxLen)
		var b strings.Builder
		for range n {
			b.WriteRune(r[rng.IntN(len(r))])
		}
		s := b.String()
		if s == "." || s == ".." {
			s += "x"
		}
		return s
	}
	var build func(depth int) *node
	build = func(depth int) *node {
		d := &node{mode: fs.ModeDir | 0o755, owned: true}
		t.Dirs++
		n := rng.IntN(12)
		switch rng.IntN(10) {
		case 0:
			n = 0
		case 1:
			n = 150 + rng.IntN(400) // several dirent blocks
		case 2:
			n = 40 + rng.IntN(60) // about one block: inline or not depending on where it lands
		}
		seen := map[string]bool{}
		for range n {
			if t.Files+t.Dirs+t.symlinks > 3000 {
				break
			}
			nm := name(1 + rng.IntN(40))
			if rng.IntN(8) == 0 {
				nm = name(255)
				if len(nm) > 255 {
					nm = nm[:200]
				}
			}
			if seen[nm] || !utf8.ValidString(nm) {
				continue
			}
			seen[nm] = true
			var c *node
			switch k := rng.IntN(10); {
			case k < 2 && depth < 6:
				c = build(depth + 1)
				d.subdirs++
			case k < 4:
				target := name(1 + rng.IntN(60))
				if rng.IntN(5) == 0 {
					target = strings.Repeat("t/", 1000+rng.IntN(1000)) // past an inode's block
				}
				c = &node{mode: fs.ModeSymlink | 0o777, target: target, owned: true}
				t.symlinks++
			default:
				c = &node{mode: 0o644, owned: true}
				if rng.IntN(3) == 0 {
					c.mode = 0o755
				}
				switch rng.IntN(6) {
				case 0: // empty
				case 1:
					c.size = rng.Int64N(1 << 22)
				default:
					c.size = 1 + rng.Int64N(40000)
				}
				if rng.IntN(400) == 0 {
					c.size = 5<<30 + rng.Int64N(1<<20) // needs an extended inode
				}
				if c.size > 0 {
					for j := range c.hash {
						c.hash[j] = byte(rng.Uint32())
					}
				}
				t.Files++
			}
			c.name = nm
			d.children = append(d.children, c)
		}
		slices.SortFunc(d.children, byName)
		return d
	}
	top := build(0)
	t.top = top
	if seed%3 == 1 { // a prefix: parents owned by 0:0
		top.name = "app"
		p := &node{mode: fs.ModeDir | 0o755, children: []*node{top}, subdirs: 1}
		t.top = p
		t.Dirs++
	}
	return t
}

package gc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// maxTreeBytes bounds how much of an object is read to use it as a tree, so a root
// that points a directory entry at a huge blob cannot exhaust memory (the store's own
// tree reader has the same limit).
const maxTreeBytes = 256 << 20

// Problem is a reachable object that is not what its parent says it is: missing,
// corrupt, or a tree that cannot be decoded.
type Problem struct {
	Hash casstore.Hash
	Tree bool          // referenced as a directory
	Root casstore.Hash // the live root it was reached from (the first one)
	Path string        // where under Root it was first reached; "" for the root itself
	Err  error
}

// String renders the problem for a one-line report: kind, hash, root:path, error.
func (p Problem) String() string {
	kind := "blob"
	if p.Tree {
		kind = "tree"
	}
	where := "/"
	if p.Path != "" {
		where = quote(p.Path)
	}
	return fmt.Sprintf("%s %s at %s:%s: %v", kind, p.Hash, p.Root.Short(), where, p.Err)
}

// Marks is the set of objects reachable from a set of roots: the mark phase of garbage
// collection, also used by fsck to find reachable objects that are missing or broken.
type Marks struct {
	seen map[casstore.Hash]uint8 // bitmask of asBlob / asTree

	// Missing lists reachable objects that are not in the store.
	Missing []Problem
	// Undecodable lists reachable trees that Tidepool's strict codec refuses (e.g.
	// LunarFS trees with unsafe names). Their children were still marked through a
	// lenient parse, so they keep their objects alive; they cannot be materialized.
	Undecodable []Problem
	// Unreadable lists reachable trees whose children are unknown: corrupt objects
	// (bytes that do not hash to the name), objects too large or too malformed to
	// parse. Garbage collection refuses to sweep while this is not empty, because
	// objects only those trees reach would look unreachable.
	Unreadable []Problem
}

const (
	asBlob uint8 = 1 << iota
	asTree
)

// Has reports whether h is reachable (as a blob, a tree or both).
func (m *Marks) Has(h casstore.Hash) bool { return m.seen[h] != 0 }

// Len is the number of distinct reachable hashes.
func (m *Marks) Len() int { return len(m.seen) }

// Mark walks every tree reachable from roots. Dedup is by (hash, use): a hash first
// met as a file is still walked when a directory entry names it, since the store has
// one namespace for both (the pitfall of LunarFS's push and pull walks).
func Mark(ctx context.Context, s *casstore.Store, roots []casstore.Hash) (*Marks, error) {
	m := &Marks{seen: map[casstore.Hash]uint8{}}
	if err := m.Extend(ctx, s, roots); err != nil {
		return nil, err
	}
	return m, nil
}

type item struct {
	h    casstore.Hash
	tree bool
	root casstore.Hash
	path string
}

// Extend marks what more roots reach. Subtrees already marked are not walked again,
// so re-marking a slightly changed set of roots costs only what changed.
func (m *Marks) Extend(ctx context.Context, s *casstore.Store, roots []casstore.Hash) error {
	stack := make([]item, 0, len(roots))
	for _, r := range roots {
		stack = append(stack, item{h: r, tree: true, root: r})
	}
	for len(stack) > 0 {
		it := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		bit := asBlob
		if it.tree {
			bit = asTree
		}
		if m.seen[it.h]&bit != 0 {
			continue
		}
		m.seen[it.h] |= bit
		if it.h == casstore.EmptyHash {
			continue // empty file or empty tree: nothing to read, nothing can be missing
		}
		if !it.tree {
			ok, err := s.Has(it.h)
			if err != nil {
				return fmt.Errorf("mark: %w", err)
			}
			if !ok {
				m.Missing = append(m.Missing, problem(it, fmt.Errorf("object %s: %w", it.h, errdefs.ErrNotFound)))
			}
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		children, err := m.children(s, it)
		if err != nil {
			return err
		}
		for _, c := range children {
			stack = append(stack, item{h: c.Hash, tree: c.Mode == casstore.ModeDir, root: it.root, path: join(it.path, c.Name)})
		}
	}
	return nil
}

func problem(it item, err error) Problem {
	return Problem{Hash: it.h, Tree: it.tree, Root: it.root, Path: it.path, Err: err}
}

// children reads a tree for marking. Problems with the object are recorded and give
// no children; only errors of the store itself (I/O, permissions) are returned.
func (m *Marks) children(s *casstore.Store, it item) ([]casstore.Entry, error) {
	size, err := s.Size(it.h)
	if err != nil {
		if errdefs.IsNotFound(err) {
			m.Missing = append(m.Missing, problem(it, err))
			return nil, nil
		}
		return nil, fmt.Errorf("mark: %w", err)
	}
	if size > maxTreeBytes {
		m.Unreadable = append(m.Unreadable, problem(it, fmt.Errorf("%d bytes is too large for a tree", size)))
		return nil, nil
	}
	b, err := s.ReadAll(it.h, maxTreeBytes)
	if err != nil {
		var ce *casstore.CorruptError
		switch {
		case errdefs.IsNotFound(err): // removed since Size
			m.Missing = append(m.Missing, problem(it, err))
			return nil, nil
		case errors.As(err, &ce):
			m.Unreadable = append(m.Unreadable, problem(it, err))
			return nil, nil
		}
		return nil, fmt.Errorf("mark: %w", err)
	}
	t, err := casstore.DecodeTree(b)
	if err == nil {
		return t, nil
	}
	lenient, lerr := parseLenient(b)
	if lerr != nil {
		m.Unreadable = append(m.Unreadable, problem(it, err))
		return nil, nil
	}
	m.Undecodable = append(m.Undecodable, problem(it, err))
	return lenient, nil
}

// parseLenient reads a tree the way LunarFS does: any mode, any name, any order. It is
// used only to find the children of a tree the strict codec refuses, so their objects
// stay alive; nothing is ever materialized from it.
func parseLenient(b []byte) ([]casstore.Entry, error) {
	var out []casstore.Entry
	for off := 0; off < len(b); {
		if len(b)-off < 8 {
			return nil, errors.New("truncated entry header")
		}
		mode := casstore.Mode(binary.LittleEndian.Uint32(b[off:]))
		n := uint64(binary.LittleEndian.Uint32(b[off+4:]))
		off += 8
		if n+casstore.HashSize > uint64(len(b)-off) {
			return nil, errors.New("entry runs past the end")
		}
		name := string(b[off : off+int(n)])
		off += int(n)
		var h casstore.Hash
		copy(h[:], b[off:])
		off += casstore.HashSize
		out = append(out, casstore.Entry{Mode: mode, Name: name, Hash: h})
	}
	return out, nil
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

package casstore

import (
	"context"
	"fmt"
	"strconv"
)

// Extent is what a walk of a tree would expand to.
type Extent struct {
	Entries int64 // entries below the root, every path counted (a shared subtree once per path)
	Depth   int   // deepest nesting of an entry (a root's own entries are at depth 1)
	Bytes   int64 // file content over every path (only with Measure's withBytes)
}

// Measure computes a tree's Extent without expanding its paths: each distinct tree
// object is read once and its extent memoized by hash, so a DAG of 41 objects
// spelling 2^40 paths costs 41 reads. It fails with ErrTreeLimit as soon as a subtree
// is past l, so a walk can refuse a tree before it prints or writes anything.
// withBytes adds up the sizes of file objects (a stat each, per distinct object).
func Measure(ctx context.Context, s *Store, root Hash, l Limits, withBytes bool) (Extent, error) {
	m := &measurer{ctx: ctx, s: s, l: l.WithDefaults(), bytes: withBytes, memo: map[Hash]Extent{}, sizes: map[Hash]int64{}}
	return m.tree(root, "", 0)
}

type measurer struct {
	ctx   context.Context
	s     *Store
	l     Limits
	bytes bool
	memo  map[Hash]Extent
	sizes map[Hash]int64
}

func (m *measurer) tree(h Hash, path string, depth int) (Extent, error) {
	if e, ok := m.memo[h]; ok {
		return e, m.check(e, depth)
	}
	if err := m.ctx.Err(); err != nil {
		return Extent{}, err
	}
	if depth >= m.l.MaxDepth {
		return Extent{}, fmt.Errorf("directories nested deeper than %d (max_tree_depth, --max-tree-depth): %w", m.l.MaxDepth, ErrTreeLimit)
	}
	t, err := m.s.ReadTree(h)
	if err != nil {
		where := "the root"
		if path != "" {
			where = strconv.Quote(path)
		}
		return Extent{}, fmt.Errorf("read tree %s at %s: %w", h, where, err)
	}
	var ext Extent
	if len(t) > 0 {
		ext.Depth = 1
	}
	for _, e := range t {
		ext.Entries++
		switch {
		case e.Mode.IsDir():
			sub, err := m.tree(e.Hash, joinPath(path, e.Name), depth+1)
			if err != nil {
				return Extent{}, err
			}
			ext.Entries += sub.Entries
			ext.Bytes += sub.Bytes
			if sub.Depth+1 > ext.Depth {
				ext.Depth = sub.Depth + 1
			}
		case m.bytes && e.Mode != ModeSymlink && e.Hash != EmptyHash:
			n, ok := m.sizes[e.Hash]
			if !ok {
				if n, err = m.s.Size(e.Hash); err != nil {
					return Extent{}, fmt.Errorf("file %s: %w", strconv.Quote(joinPath(path, e.Name)), err)
				}
				m.sizes[e.Hash] = n
			}
			ext.Bytes += n
		}
		if err := m.check(ext, depth); err != nil {
			return Extent{}, err
		}
	}
	m.memo[h] = ext
	return ext, nil
}

// check refuses an extent that, at this depth, is past a limit. Sums saturate at the
// limit check, so they cannot overflow.
func (m *measurer) check(e Extent, depth int) error {
	switch {
	case e.Entries > m.l.MaxEntries:
		return fmt.Errorf("more than %d entries (max_tree_entries, --max-tree-entries): %w", m.l.MaxEntries, ErrTreeLimit)
	case depth+e.Depth > m.l.MaxDepth:
		return fmt.Errorf("directories nested deeper than %d (max_tree_depth, --max-tree-depth): %w", m.l.MaxDepth, ErrTreeLimit)
	case m.bytes && e.Bytes > m.l.MaxBytes:
		return fmt.Errorf("more than %d bytes of content (max_tree_bytes, --max-tree-bytes): %w", m.l.MaxBytes, ErrTreeLimit)
	}
	return nil
}

func joinPath(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

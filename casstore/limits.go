package casstore

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"
)

// A tree is a DAG: 41 tree objects, each naming the one below twice, spell 2^40
// paths. Every walk that expands paths (listing, checkout, diff, a view's
// directories) therefore runs under Limits and honours its context, and refuses a
// tree past a limit with ErrTreeLimit instead of running for hours. Walks that only
// need each object once (gc's mark, fsck) visit objects, not paths, and stay linear
// in the number of objects.

// Limits bound one walk of a tree. Zero fields take the defaults.
type Limits struct {
	// MaxEntries is the most entries (paths) one walk may visit.
	MaxEntries int64 `toml:"max_tree_entries" comment:"Most entries (paths, counted as expanded) one walk of a tree may visit: ls-tree -r, checkout, diff,\none directory of a view. A tree is a DAG, so a few objects can spell billions of paths."`
	// MaxDepth is the deepest directory nesting a walk descends to.
	MaxDepth int `toml:"max_tree_depth" comment:"Deepest directory nesting a walk descends to (Linux paths stop at 4096 bytes, so ~2048 levels at most)."`
	// MaxBytes is the most file content a walk may write (checkout).
	MaxBytes int64 `toml:"max_tree_bytes" comment:"Most bytes of file content one checkout may write."`
}

// Defaults for Limits: far above real source trees (the Go tree is 12k entries, the
// Linux kernel 90k, Chromium's checkout about 500k), far below what a hostile DAG
// can spell; a diff holds its changes in memory, ~100 bytes each.
const (
	DefaultMaxEntries = 2_000_000
	DefaultMaxDepth   = 1024
	DefaultMaxBytes   = 1 << 40 // 1 TiB
)

// DefaultLimits returns the default limits.
func DefaultLimits() Limits {
	return Limits{MaxEntries: DefaultMaxEntries, MaxDepth: DefaultMaxDepth, MaxBytes: DefaultMaxBytes}
}

// WithDefaults fills zero fields with the defaults.
func (l Limits) WithDefaults() Limits {
	d := DefaultLimits()
	if l.MaxEntries <= 0 {
		l.MaxEntries = d.MaxEntries
	}
	if l.MaxDepth <= 0 {
		l.MaxDepth = d.MaxDepth
	}
	if l.MaxBytes <= 0 {
		l.MaxBytes = d.MaxBytes
	}
	return l
}

// ErrTreeLimit is wrapped by the error of a walk refused by its Limits.
var ErrTreeLimit = fmt.Errorf("tree exceeds a walk limit: %w", errdefs.ErrOutOfRange)

// Budget is one walk's running account against its Limits, and its context.
type Budget struct {
	ctx     context.Context
	l       Limits
	entries int64
	bytes   int64
}

// NewBudget starts a walk's account; zero limit fields take the defaults.
func NewBudget(ctx context.Context, l Limits) *Budget {
	return &Budget{ctx: ctx, l: l.WithDefaults()}
}

// Entries charges n visited entries and checks the context.
func (b *Budget) Entries(n int) error {
	if err := b.ctx.Err(); err != nil {
		return err
	}
	b.entries += int64(n)
	if b.entries > b.l.MaxEntries {
		return fmt.Errorf("more than %d entries (max_tree_entries, --max-tree-entries): %w", b.l.MaxEntries, ErrTreeLimit)
	}
	return nil
}

// Depth checks a directory nesting level (the root's children are at depth 1).
func (b *Budget) Depth(d int) error {
	if d > b.l.MaxDepth {
		return fmt.Errorf("directories nested deeper than %d (max_tree_depth, --max-tree-depth): %w", b.l.MaxDepth, ErrTreeLimit)
	}
	return nil
}

// Bytes charges n bytes of content.
func (b *Budget) Bytes(n int64) error {
	b.bytes += n
	if b.bytes > b.l.MaxBytes {
		return fmt.Errorf("more than %d bytes of content (max_tree_bytes, --max-tree-bytes): %w", b.l.MaxBytes, ErrTreeLimit)
	}
	return nil
}

// Visited is how many entries the walk has been charged so far.
func (b *Budget) Visited() int64 { return b.entries }

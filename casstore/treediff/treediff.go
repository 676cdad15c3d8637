// Package treediff compares two roots of the content-addressed store. Because every
// subtree is named by the hash of its content, two subtrees with the same hash and mode
// are identical and are never opened: the cost of a diff follows the size of the
// change, not the size of the trees.
//
// The result follows LunarFS's diff (a directory replaced by a file, or the reverse,
// is a deletion of every leaf on one side and an addition of every leaf on the other)
// with two corrections: mode-only changes are reported (status 'T'), and an entry whose
// hash is unchanged but whose mode is not (an empty file replaced by an empty directory,
// which share H("")) is not skipped.
package treediff

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Statuses of a Change.
const (
	Added    byte = 'A' // present only in the new root
	Modified byte = 'M' // same non-directory mode, different content
	Deleted  byte = 'D' // present only in the old root
	TypeMode byte = 'T' // non-directory on both sides with different modes (content may differ too)
)

// Change is one difference between two roots. Leaves only: a file, a symlink or an
// empty directory, never a non-empty directory. The side that does not exist (old for
// Added, new for Deleted) has a zero Mode and a zero Hash.
type Change struct {
	Status  byte
	Path    string // relative, '/'-separated
	OldMode casstore.Mode
	NewMode casstore.Mode
	OldHash casstore.Hash
	NewHash casstore.Hash
}

// String renders the change as the CLI prints it: "A path".
func (c Change) String() string { return string(c.Status) + " " + c.Path }

// MarshalJSON gives the `tidepool diff --json` shape: status as a one-letter string,
// modes as six octal digits and hashes as hex, with null for the side that is absent.
func (c Change) MarshalJSON() ([]byte, error) {
	type side struct {
		mode *string
		hash *string
	}
	get := func(m casstore.Mode, h casstore.Hash) side {
		if m == 0 {
			return side{}
		}
		ms, hs := m.String(), h.String()
		return side{&ms, &hs}
	}
	o, n := get(c.OldMode, c.OldHash), get(c.NewMode, c.NewHash)
	return json.Marshal(struct {
		Status  string  `json:"status"`
		Path    string  `json:"path"`
		OldMode *string `json:"old_mode"`
		NewMode *string `json:"new_mode"`
		OldHash *string `json:"old_hash"`
		NewHash *string `json:"new_hash"`
	}{string(c.Status), c.Path, o.mode, n.mode, o.hash, n.hash})
}

// TreeReader reads decoded trees. *casstore.Store implements it; tests wrap it to
// count reads, and a remote or caching reader can stand in for it.
type TreeReader interface {
	ReadTree(h casstore.Hash) (casstore.Tree, error)
}

var _ TreeReader = (*casstore.Store)(nil)

// Diff lists the changes that turn root a into root b, sorted by the bytes of their
// paths (a deletion before an addition at the same path). Only subtrees that differ
// are read; equal roots read nothing.
func Diff(ctx context.Context, r TreeReader, a, b casstore.Hash) ([]Change, error) {
	return DiffLimited(ctx, r, a, b, casstore.Limits{})
}

// DiffLimited is Diff under walk limits: it fails with casstore.ErrTreeLimit once the
// trees it expands (and the changes it lists) pass l.MaxEntries or nest past
// l.MaxDepth, and with ctx's error once ctx is done. Tree objects are read once each
// (memoized by hash), so subtrees shared across paths cost one read.
func DiffLimited(ctx context.Context, r TreeReader, a, b casstore.Hash, l casstore.Limits) ([]Change, error) {
	if a == b {
		return nil, nil
	}
	d := &differ{ctx: ctx, r: r, budget: casstore.NewBudget(ctx, l), cache: map[casstore.Hash]casstore.Tree{}}
	if err := d.trees("", a, b); err != nil {
		return nil, err
	}
	sort.SliceStable(d.out, func(i, j int) bool {
		x, y := d.out[i], d.out[j]
		if c := bytes.Compare([]byte(x.Path), []byte(y.Path)); c != 0 {
			return c < 0
		}
		return rank(x.Status) < rank(y.Status)
	})
	return d.out, nil
}

// rank orders changes at one path: the deletion comes before the addition, as it
// would be applied.
func rank(s byte) int {
	if s == Deleted {
		return 0
	}
	return 1
}

type differ struct {
	ctx    context.Context
	r      TreeReader
	out    []Change
	budget *casstore.Budget
	cache  map[casstore.Hash]casstore.Tree
}

// maxCachedTrees bounds the memo of decoded trees.
const maxCachedTrees = 1 << 16

func (d *differ) read(path string, h casstore.Hash) (casstore.Tree, error) {
	if err := d.ctx.Err(); err != nil {
		return nil, err
	}
	if err := d.budget.Depth(strings.Count(path, "/") + 1); err != nil && path != "" {
		return nil, fmt.Errorf("diff at %s: %w", display(path), err)
	}
	t, ok := d.cache[h]
	if !ok {
		var err error
		if t, err = d.r.ReadTree(h); err != nil {
			return nil, fmt.Errorf("diff: read tree %s at %s: %w", h, display(path), err)
		}
		if len(d.cache) < maxCachedTrees {
			d.cache[h] = t
		}
	}
	if err := d.budget.Entries(len(t)); err != nil {
		return nil, fmt.Errorf("diff at %s: %w", display(path), err)
	}
	return t, nil
}

// trees compares two directories whose hashes differ.
func (d *differ) trees(path string, a, b casstore.Hash) error {
	ta, err := d.read(path, a)
	if err != nil {
		return err
	}
	tb, err := d.read(path, b)
	if err != nil {
		return err
	}
	i, j := 0, 0
	for i < len(ta) || j < len(tb) {
		switch {
		case j == len(tb) || i < len(ta) && ta[i].Name < tb[j].Name:
			if err := d.expand(Deleted, join(path, ta[i].Name), ta[i]); err != nil {
				return err
			}
			i++
		case i == len(ta) || tb[j].Name < ta[i].Name:
			if err := d.expand(Added, join(path, tb[j].Name), tb[j]); err != nil {
				return err
			}
			j++
		default:
			if err := d.entry(join(path, ta[i].Name), ta[i], tb[j]); err != nil {
				return err
			}
			i++
			j++
		}
	}
	return nil
}

// entry compares the two sides of one name.
func (d *differ) entry(path string, ea, eb casstore.Entry) error {
	if ea.Hash == eb.Hash && ea.Mode == eb.Mode {
		return nil // identical: never opened
	}
	da, db := ea.Mode.IsDir(), eb.Mode.IsDir()
	switch {
	case da && db:
		return d.trees(path, ea.Hash, eb.Hash)
	case !da && !db:
		st := Modified
		if ea.Mode != eb.Mode {
			st = TypeMode
		}
		if err := d.budget.Entries(1); err != nil {
			return fmt.Errorf("diff at %s: %w", display(path), err)
		}
		d.out = append(d.out, Change{Status: st, Path: path, OldMode: ea.Mode, NewMode: eb.Mode, OldHash: ea.Hash, NewHash: eb.Hash})
		return nil
	default:
		if err := d.expand(Deleted, path, ea); err != nil {
			return err
		}
		return d.expand(Added, path, eb)
	}
}

// expand reports an entry that exists on one side only, down to its leaves. An empty
// directory is a leaf.
func (d *differ) expand(st byte, path string, e casstore.Entry) error {
	if e.Mode.IsDir() {
		t, err := d.read(path, e.Hash)
		if err != nil {
			return err
		}
		if len(t) > 0 {
			for _, c := range t {
				if err := d.expand(st, join(path, c.Name), c); err != nil {
					return err
				}
			}
			return nil
		}
	}
	if err := d.budget.Entries(1); err != nil {
		return fmt.Errorf("diff at %s: %w", display(path), err)
	}
	c := Change{Status: st, Path: path}
	if st == Deleted {
		c.OldMode, c.OldHash = e.Mode, e.Hash
	} else {
		c.NewMode, c.NewHash = e.Mode, e.Hash
	}
	d.out = append(d.out, c)
	return nil
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

func display(path string) string {
	if path == "" {
		return "the root"
	}
	return fmt.Sprintf("%q", path)
}

package kview

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// scanWorkers is how many tree objects a scan reads at once. Reads of a warm store
// are system calls on cached pages, so a few workers per CPU keep every CPU busy.
const scanWorkers = 8

// Tree is a tree scanned from the store with everything an image needs: every
// directory decoded, every file's size, every symlink's target.
type Tree struct {
	spec  Spec
	top   *node // the image root
	Files int   // regular files
	Dirs  int
	Bytes int64 // total size of the files
	// Stats says where file sizes came from: the store's size index, or a stat of
	// the object (objects stored before the index existed, or by LunarFS).
	Indexed, Stated int
	// TreesRead is how many tree objects the scan read from the store; the others
	// came from the memo of decoded trees.
	TreesRead int
	// sizesAt is the size index's epoch the scan's size lookups saw (or a later one);
	// sizesKnown says the index had every file's size (checked.go).
	sizesAt    casstore.SizeEpoch
	sizesKnown bool

	objects  []casstore.Hash // the objects files point at, each once
	symlinks int
}

// dirScan is what one tree object gives: its entries, and for each entry the size
// of its object (files) or its target (symlinks).
type dirScan struct {
	tree    casstore.Tree
	missing bool    // the tree object itself is not local
	read    bool    // the tree object was read from the store (not the memo)
	sizes   []int64 // per entry: a file's size; -1: its object is missing
	targets []string
	absent  []casstore.Hash // objects of entries not in the store
	indexed int
	stated  int
}

// Scan walks spec.Root in store, checking that every object it references is local.
// It is the one place where a tree's objects are checked for local presence: a tree
// with objects missing returns a *MissingError naming all of them (a remote store can
// hydrate exactly those and scan again); a tree that cannot be read at all returns
// another error.
//
// File sizes come from the store's size index where it has them (see
// casstore.Store.KnownSize: an entry is written only once its object is durable and
// dropped before anything removes the object), and from a stat of the object
// otherwise. Tree objects are read and decoded by several workers at once.
func Scan(ctx context.Context, store *casstore.Store, spec Spec) (*Tree, error) {
	return scan(ctx, store, spec, nil, &scratch{})
}

// scan is Scan with decoded tree objects remembered in memo (if not nil) from one
// scan to the next: tree objects never change, so a view of a new root (a commit's,
// another owner's) decodes only the trees it does not share with earlier views.
// File objects are still looked up every time (index, then stat); tree objects a
// memo holds are not re-read, and need not be local: the image never reads them.
// The Tree is assembled in sc (scratch.go), and valid as long as sc is not reset.
func scan(ctx context.Context, store *casstore.Store, spec Spec, memo *treeMemo, sc *scratch) (*Tree, error) {
	od := newObjDirs(store)
	od.memo = memo
	defer od.close()
	scans, err := readTrees(ctx, od, spec.Root)
	if err != nil {
		return nil, err
	}
	// Entries of distinct tree objects: the number of files in a tree without shared
	// subtrees, sizing the object list and its set once instead of growing them.
	hint := 0
	for _, ds := range scans {
		hint += len(ds.tree)
	}
	if sc.seen == nil {
		sc.seen = make(map[casstore.Hash]struct{}, hint)
	}
	if cap(sc.objects) < hint {
		sc.objects = make([]casstore.Hash, 0, hint)
	}
	as := &assembler{ctx: ctx, scans: scans, budget: casstore.DefaultLimits(), sc: sc,
		missing: map[casstore.Hash]struct{}{}, t: &Tree{spec: spec, objects: sc.objects[:0]}}
	t := as.t
	owned := &node{mode: fs.ModeDir | 0o755, hash: spec.Root, owned: true}
	err = as.dir(owned, spec.Root, 0)
	sc.objects = t.objects // keeps what append grew
	if err != nil {
		return nil, err
	}
	if len(as.order) > 0 {
		return nil, &MissingError{Root: spec.Root, Objects: as.order}
	}
	for _, s := range scans {
		t.Indexed += s.indexed
		t.Stated += s.stated
		if s.read {
			t.TreesRead++
		}
	}
	t.top = owned
	t.sizesAt, t.sizesKnown = od.epoch, od.epochOK && t.Stated == 0
	if spec.Prefix != "" {
		parts := strings.Split(spec.Prefix, "/")
		owned.name = parts[len(parts)-1]
		cur := owned
		for i := len(parts) - 2; i >= -1; i-- {
			p := &node{mode: fs.ModeDir | 0o755, children: []*node{cur}, subdirs: 1}
			if i >= 0 {
				p.name = parts[i]
			}
			cur = p
			t.Dirs++
		}
		t.top = cur
	}
	return t, nil
}

// readTrees reads every tree object reachable from root, level by level, each level
// by scanWorkers workers, with the sizes of the files and the targets of the
// symlinks they name.
func readTrees(ctx context.Context, od *objDirs, root casstore.Hash) (map[casstore.Hash]*dirScan, error) {
	scans := map[casstore.Hash]*dirScan{}
	level := []casstore.Hash{root}
	scans[root] = nil
	for len(level) > 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		out := make([]*dirScan, len(level))
		var next atomic.Int64
		var firstErr error
		var errOnce sync.Once
		var wg sync.WaitGroup
		for w := 0; w < min(scanWorkers, len(level)); w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= len(level) {
						return
					}
					ds, err := od.scanDir(level[i])
					if err != nil {
						errOnce.Do(func() { firstErr = err })
						return
					}
					out[i] = ds
				}
			}()
		}
		wg.Wait()
		if firstErr != nil {
			return nil, firstErr
		}
		var below []casstore.Hash
		for i, h := range level {
			scans[h] = out[i]
			for _, e := range out[i].tree {
				if e.Mode == casstore.ModeDir {
					if _, ok := scans[e.Hash]; !ok {
						scans[e.Hash] = nil
						below = append(below, e.Hash)
					}
				}
			}
		}
		level = below
	}
	return scans, nil
}

// assembler turns the scanned tree objects into the node tree of one view,
// expanding shared subtrees once per path, under the walk limits.
type assembler struct {
	ctx     context.Context
	scans   map[casstore.Hash]*dirScan
	budget  casstore.Limits
	n       int64
	t       *Tree
	missing map[casstore.Hash]struct{}
	order   []casstore.Hash
	sc      *scratch // nodes come from it; sc.seen: file objects already in t.objects
}

func (as *assembler) miss(h casstore.Hash) {
	if _, ok := as.missing[h]; !ok {
		as.missing[h] = struct{}{}
		as.order = append(as.order, h)
	}
}

func (as *assembler) dir(n *node, h casstore.Hash, depth int) error {
	t := as.t
	t.Dirs++
	if depth > as.budget.MaxDepth {
		return fmt.Errorf("tree %s: deeper than %d directories: %w", t.spec.Root.Short(), as.budget.MaxDepth, casstore.ErrTreeLimit)
	}
	ds := as.scans[h]
	if ds.missing {
		as.miss(h)
		return nil
	}
	as.n += int64(len(ds.tree))
	if as.n > as.budget.MaxEntries {
		return fmt.Errorf("tree %s: more than %d entries: %w", t.spec.Root.Short(), as.budget.MaxEntries, casstore.ErrTreeLimit)
	}
	if as.n%4096 < int64(len(ds.tree)) {
		if err := as.ctx.Err(); err != nil {
			return err
		}
	}
	n.children = as.sc.kids.take(len(ds.tree))
	nodes := as.sc.nodes.take(len(ds.tree))
	for i, e := range ds.tree {
		c := &nodes[i]
		*c = node{name: e.Name, hash: e.Hash, owned: true}
		n.children[i] = c
		switch e.Mode {
		case casstore.ModeDir:
			c.mode = fs.ModeDir | 0o755
			n.subdirs++
			if err := as.dir(c, e.Hash, depth+1); err != nil {
				return err
			}
		case casstore.ModeSymlink:
			c.mode = fs.ModeSymlink | 0o777
			if ds.sizes[i] < 0 {
				as.miss(e.Hash)
			}
			c.target = ds.targets[i]
			t.symlinks++
		case casstore.ModeFile, casstore.ModeExec:
			c.mode = 0o644
			if e.Mode == casstore.ModeExec {
				c.mode = 0o755
			}
			t.Files++
			if e.Hash == casstore.EmptyHash {
				continue
			}
			if ds.sizes[i] < 0 {
				as.miss(e.Hash)
				continue
			}
			c.size = ds.sizes[i]
			t.Bytes += c.size
			if _, ok := as.sc.seen[e.Hash]; !ok {
				as.sc.seen[e.Hash] = struct{}{}
				t.objects = append(t.objects, e.Hash)
			}
		}
	}
	return nil
}

// objDirs reads objects relative to their fan-out directories (opened once per
// scan), which saves most of each path lookup, and answers sizes from the store's
// size index first.
type objDirs struct {
	memo  *treeMemo
	store *casstore.Store
	root  string
	index bool // answer sizes from the store's size index first
	// epoch is the size index's epoch once refreshed, before any lookup (epochOK:
	// there is an index): every lookup sees it or a later one.
	epoch   casstore.SizeEpoch
	epochOK bool
	// treesOnly: decode trees (and read symlink targets) without looking up file
	// sizes, to fill the memo (warm.go).
	treesOnly bool
	fanouts   [256]struct {
		once sync.Once
		fd   int // -1: the fan-out directory does not exist
		err  error
	}
}

// newObjDirs reads the objects of store. It refreshes the store's size index, and
// uses it only if that works (the index only saves time).
//
// Objects this process published late (casstore's late.go: a branch or a pull returns
// once its journal is durable) are under their names first, since a scan reads object
// files directly; those of other processes' journals are put in place as the scan
// misses them (lookup).
func newObjDirs(store *casstore.Store) *objDirs {
	store.WaitPublished()
	od := &objDirs{store: store, root: store.Root(), index: store.RefreshSizes() == nil}
	if od.index {
		od.epoch, od.epochOK = store.SizeEpoch()
	}
	return od
}

func (od *objDirs) close() {
	for i := range od.fanouts {
		f := &od.fanouts[i]
		f.once.Do(func() { f.fd = -1 })
		if f.fd >= 0 {
			unix.Close(f.fd)
			f.fd = -1
		}
	}
}

// dir returns the fan-out directory of h, or -1 if it does not exist.
func (od *objDirs) dir(h casstore.Hash) (int, error) {
	f := &od.fanouts[h[0]]
	f.once.Do(func() {
		x := h.String()
		fd, err := unix.Open(path.Join(od.root, x[:2]), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		switch {
		case err == nil:
			f.fd = fd
		case errors.Is(err, unix.ENOENT):
			f.fd = -1
		default:
			f.fd, f.err = -1, fmt.Errorf("object directory %s: %w", x[:2], err)
		}
	})
	return f.fd, f.err
}

// lookup runs op (a stat or an open) on h's file in its fan-out directory and
// reports whether the file is there. A missing file may still be in a journal (a
// pull's or a branch's objects reach their names in the background, see casstore's
// late.go and stream.go): the image names object files directly, so Materialize
// puts such an object in place and op runs again on its full path. ok is false if
// the object is in neither.
func (od *objDirs) lookup(h casstore.Hash, op func(dirfd int, name string) error) (bool, error) {
	fd, err := od.dir(h)
	if err != nil {
		return false, err
	}
	if fd >= 0 {
		err := op(fd, h.String()[2:])
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, unix.ENOENT) {
			return false, fmt.Errorf("object %s: %w", h, err)
		}
	}
	if ok, err := od.store.Materialize(h); err != nil || !ok {
		return false, err
	}
	err = op(unix.AT_FDCWD, od.store.Path(h))
	switch {
	case errors.Is(err, unix.ENOENT):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("object %s: %w", h, err)
	}
	return true, nil
}

// known answers a size from the size index.
func (od *objDirs) known(h casstore.Hash) (int64, bool) {
	if !od.index {
		return 0, false
	}
	return od.store.KnownSize(h)
}

// stat returns an object's size from its file; ok is false if it is not in the store.
func (od *objDirs) stat(h casstore.Hash) (int64, bool, error) {
	var s unix.Stat_t
	ok, err := od.lookup(h, func(dirfd int, name string) error {
		return unix.Fstatat(dirfd, name, &s, unix.AT_SYMLINK_NOFOLLOW)
	})
	if err != nil || !ok {
		return 0, false, err
	}
	if s.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, false, fmt.Errorf("object %s is not a regular file: %w", h, errdefs.ErrDataLoss)
	}
	return s.Size, true, nil
}

// read returns a whole object of at most max bytes, verified against its name; ok is
// false if it is not in the store. The bytes are in buf (from readBufs) when the
// object fits there, so the caller must be done with them before it puts buf back.
//
// Most objects read here (tree objects, symlink targets) are small, so read first
// tries one pread into buf and no fstat: a read that returns less than buf holds is
// the whole of a regular file, and a hash match proves that the bytes are the
// object (only its bytes hash to its name). Anything else (a bigger object, a
// mismatch, a read error, a file that is not regular) takes the careful path, which
// stats the file first and says what is wrong with it.
func (od *objDirs) read(h casstore.Hash, max int64, buf []byte) ([]byte, bool, error) {
	fd := -1
	ok, err := od.lookup(h, func(dirfd int, name string) (err error) {
		fd, err = unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
		return err
	})
	if err != nil || !ok {
		return nil, false, err
	}
	defer unix.Close(fd)
	if n, err := preadOnce(fd, buf); err == nil && n < len(buf) && int64(n) <= max && casstore.Sum(buf[:n]) == h {
		return buf[:n], true, nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, false, fmt.Errorf("object %s: %w", h, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, false, fmt.Errorf("object %s is not a regular file: %w", h, errdefs.ErrDataLoss)
	}
	if st.Size > max {
		return nil, false, fmt.Errorf("object %s: %d bytes is more than the %d allowed here", h, st.Size, max)
	}
	b := buf
	if st.Size >= int64(len(buf)) {
		b = make([]byte, st.Size)
	}
	b = b[:st.Size]
	n, err := preadFull(fd, b)
	if err != nil {
		return nil, false, fmt.Errorf("object %s: read: %w", h, err)
	}
	if n < len(b) {
		return nil, false, fmt.Errorf("object %s: shrank while it was read: %w", h, errdefs.ErrDataLoss)
	}
	if got := casstore.Sum(b); got != h {
		return nil, false, &casstore.CorruptError{Hash: h, Got: got, Path: path.Join(od.root, h.String()[:2], h.String()[2:])}
	}
	return b, true, nil
}

// preadOnce is one pread from the start of the file (again if interrupted).
func preadOnce(fd int, b []byte) (int, error) {
	for {
		n, err := unix.Pread(fd, b, 0)
		if err != unix.EINTR {
			return n, err
		}
	}
}

// preadFull reads the file into b from its start until b is full or the file ends,
// and returns how many bytes it read.
func preadFull(fd int, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := unix.Pread(fd, b[n:], int64(n))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if m == 0 {
			break
		}
		n += m
	}
	return n, nil
}

// readBufs holds the buffers read fills: a build reads an object per directory,
// and most fit in one.
var readBufs = sync.Pool{New: func() any { b := make([]byte, 64<<10); return &b }}

// maxTreeObject bounds a tree object read here (as the store does).
const maxTreeObject = 256 << 20

// scanDir reads and decodes one tree object and learns the sizes of its files and
// the targets of its symlinks.
func (od *objDirs) scanDir(h casstore.Hash) (*dirScan, error) {
	ds := &dirScan{}
	var buf *[]byte // from readBufs, once something is read
	defer func() {
		if buf != nil {
			readBufs.Put(buf)
		}
	}()
	readBuf := func() []byte {
		if buf == nil {
			buf = readBufs.Get().(*[]byte)
		}
		return *buf
	}
	var memoTargets []string
	if m, ok := od.memo.get(h); ok {
		ds.tree, memoTargets = m.tree, m.targets
	} else if h != casstore.EmptyHash {
		b, ok, err := od.read(h, maxTreeObject, readBuf())
		if err != nil {
			return nil, fmt.Errorf("read tree %s: %w", h, err)
		}
		if !ok {
			ds.missing = true
			return ds, nil
		}
		ds.read = true
		if ds.tree, err = casstore.DecodeTree(b); err != nil {
			return nil, fmt.Errorf("tree %s: %w", h, err)
		}
	}
	ds.sizes = make([]int64, len(ds.tree))
	for i, e := range ds.tree {
		switch e.Mode {
		case casstore.ModeDir:
		case casstore.ModeSymlink:
			if memoTargets != nil {
				ds.targets = memoTargets
				if _, ok := od.known(e.Hash); ok {
					continue
				}
				if _, ok, err := od.stat(e.Hash); err != nil {
					return nil, err
				} else if !ok {
					ds.sizes[i] = -1
				}
				continue
			}
			if ds.targets == nil {
				ds.targets = make([]string, len(ds.tree))
			}
			b, ok, err := od.read(e.Hash, maxSymlinkTarget, readBuf())
			if err != nil {
				return nil, fmt.Errorf("symlink %s: %w", e.Name, err)
			}
			if !ok {
				ds.sizes[i] = -1
				continue
			}
			ds.targets[i] = string(b)
		case casstore.ModeFile, casstore.ModeExec:
			if e.Hash == casstore.EmptyHash || od.treesOnly {
				continue
			}
			if size, ok := od.known(e.Hash); ok {
				ds.sizes[i] = size
				ds.indexed++
				continue
			}
			size, ok, err := od.stat(e.Hash)
			if err != nil {
				return nil, err
			}
			if !ok {
				ds.sizes[i] = -1
				continue
			}
			ds.sizes[i] = size
			ds.stated++
		default:
			return nil, fmt.Errorf("tree %s: entry %q has unknown mode %s", h.Short(), e.Name, e.Mode)
		}
	}
	if memoTargets == nil {
		complete := true
		for i, e := range ds.tree {
			if e.Mode == casstore.ModeSymlink && ds.sizes[i] < 0 {
				complete = false // a target we could not read: do not remember ""
			}
		}
		if complete {
			od.memo.put(h, ds.tree, ds.targets)
		}
	}
	return ds, nil
}

// treeMemo remembers decoded tree objects (and their symlinks' targets) across
// scans, up to maxEntries entries in all; past that it starts over, which bounds
// its memory (~100 bytes an entry) without bookkeeping on the hot path.
type treeMemo struct {
	mu         sync.Mutex
	m          map[casstore.Hash]memoTree
	entries    int
	maxEntries int
}

type memoTree struct {
	tree    casstore.Tree
	targets []string // nil: no symlinks
}

// defaultMemoEntries is about 20 MB of decoded trees: a few trees the size of
// the Go source tree's 12k entries or one the size of a large monorepo.
const defaultMemoEntries = 200_000

func newTreeMemo(maxEntries int) *treeMemo {
	return &treeMemo{m: map[casstore.Hash]memoTree{}, maxEntries: maxEntries}
}

func (tm *treeMemo) get(h casstore.Hash) (memoTree, bool) {
	if tm == nil {
		return memoTree{}, false
	}
	tm.mu.Lock()
	defer tm.mu.Unlock()
	t, ok := tm.m[h]
	return t, ok
}

// size is how many entries the memo holds (each tree counts one more than its
// entries).
func (tm *treeMemo) size() int {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	return tm.entries
}

func (tm *treeMemo) put(h casstore.Hash, t casstore.Tree, targets []string) {
	if tm == nil {
		return
	}
	tm.mu.Lock()
	defer tm.mu.Unlock()
	if _, ok := tm.m[h]; ok {
		return
	}
	if tm.entries+len(t) > tm.maxEntries {
		clear(tm.m)
		tm.entries = 0
	}
	tm.m[h] = memoTree{tree: t, targets: targets}
	tm.entries += len(t) + 1
}

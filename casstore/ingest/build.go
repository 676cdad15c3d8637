package ingest

import (
	"context"
	"fmt"
	"os"
	"sync"

	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"

	"github.com/tidepool-dev/tidepool/casstore"
)

// child is one entry of a directory being built. Its hash is known when the child is
// created (reused subtrees, symlinks, metacopy files), filled in by a worker (regular
// files), or computed when the tree is finished (dir != nil).
type child struct {
	name string // UTF-8 name written to the tree
	raw  string // name as the OS spelled it, for error messages
	mode casstore.Mode
	hash casstore.Hash
	dir  *dirNode
	// file marks a regular file still to be stored by a worker; size is its size.
	file bool
	size int64
	// src, if set, is where a file's data is read instead of its own path (Upper: a
	// metadata-only copy-up whose data is in a lower layer).
	src string
	// walk marks a directory still to be walked, merged over its lower directory
	// (Upper only).
	walk  bool
	lower lowerRef
}

// dirNode is a directory whose tree object is written once every child hash is known.
type dirNode struct {
	path     string
	children []child
}

// fileJob asks a worker to store one regular file and record its hash in dst.
type fileJob struct {
	path string
	dst  *casstore.Hash
}

// builder runs one ingest: a single walker goroutine decides the shape of the tree and
// queues regular files for a bounded pool of workers that hash and stage them; trees are
// written afterwards, deepest first, so the result does not depend on worker timing.
type builder struct {
	ctx   context.Context // cancelled on the first error
	store *casstore.Store
	batch *casstore.Batch
	opts  Options
	jobs  *jobQueue
	c     counters

	// Upper only: the base root and the prefix it sits at, for metacopy redirects.
	base   casstore.Hash
	prefix string
}

// build runs walk under a fresh batch and returns the root tree's hash. The batch is
// committed only if everything succeeded; otherwise it is aborted, leaving the store
// as it was.
func build(ctx context.Context, store *casstore.Store, opts Options, walk func(b *builder) (*dirNode, error)) (casstore.Hash, Stats, error) {
	batch, err := store.Begin()
	if err != nil {
		return casstore.Hash{}, Stats{}, err
	}
	if opts.BufferBytes > 0 {
		batch.Buffer(opts.BufferBytes)
	}
	committed := false
	defer func() {
		if !committed {
			batch.Abort()
		}
	}()
	workers := opts.Workers
	if workers <= 0 {
		workers = defaultWorkers
	}
	g, gctx := errgroup.WithContext(ctx)
	b := &builder{ctx: gctx, store: store, batch: batch, opts: opts, jobs: newJobQueue()}
	b.c.cb = opts.Progress
	for i := 0; i < workers; i++ {
		g.Go(b.worker)
	}
	var root *dirNode
	g.Go(func() error {
		defer b.jobs.close()
		var err error
		root, err = walk(b)
		if err == nil {
			b.c.walkDone.Store(true)
			b.c.report(true)
		}
		return err
	})
	if err := g.Wait(); err != nil {
		if ctx.Err() != nil {
			return casstore.Hash{}, Stats{}, ctx.Err()
		}
		return casstore.Hash{}, Stats{}, err
	}
	b.ctx = ctx // errgroup cancels gctx once Wait returns
	if opts.Read != nil {
		opts.Read()
	}
	h, err := b.finish(root)
	if err != nil {
		return casstore.Hash{}, Stats{}, err
	}
	if err := ctx.Err(); err != nil {
		return casstore.Hash{}, Stats{}, err
	}
	release, err := batch.Publish()
	committed = true
	if err != nil {
		return casstore.Hash{}, Stats{}, fmt.Errorf("commit objects: %w", err)
	}
	if opts.Record != nil {
		err = opts.Record(h)
	}
	release()
	if err != nil {
		return casstore.Hash{}, Stats{}, err
	}
	b.c.report(true)
	return h, b.c.stats(), nil
}

func (b *builder) worker() error {
	for {
		j, ok := b.jobs.pop()
		if !ok {
			return nil
		}
		if err := b.ctx.Err(); err != nil {
			return err
		}
		h, size, err := b.batch.PutFile(j.path)
		if err != nil {
			return err // PutFile names the file
		}
		*j.dst = h
		b.c.files.Add(1)
		b.c.bytes.Add(size)
		b.c.report(false)
	}
}

// addFile queues a regular file for a worker; its hash lands in *dst. The queue is
// unbounded, so the walk runs ahead of the hashing and the totals a progress bar needs
// are known early; a queued job costs a few dozen bytes.
func (b *builder) addFile(path string, size int64, dst *casstore.Hash) {
	b.c.foundFiles.Add(1)
	b.c.foundBytes.Add(size)
	b.jobs.push(fileJob{path: path, dst: dst})
}

// jobQueue is an unbounded FIFO of file jobs: one producer (the walker), many
// consumers (the workers).
type jobQueue struct {
	mu     sync.Mutex
	ready  *sync.Cond
	items  []fileJob
	head   int
	closed bool
}

func newJobQueue() *jobQueue {
	q := &jobQueue{}
	q.ready = sync.NewCond(&q.mu)
	return q
}

func (q *jobQueue) push(j fileJob) {
	q.mu.Lock()
	q.items = append(q.items, j)
	q.mu.Unlock()
	q.ready.Signal()
}

// close tells the workers that nothing more will come; they drain what is queued.
func (q *jobQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.ready.Broadcast()
}

// pop waits for a job; ok is false once the queue is closed and empty.
func (q *jobQueue) pop() (j fileJob, ok bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.head == len(q.items) && !q.closed {
		q.ready.Wait()
	}
	if q.head == len(q.items) {
		return fileJob{}, false
	}
	j = q.items[q.head]
	q.items[q.head] = fileJob{}
	q.head++
	if q.head == len(q.items) { // drained: reuse the backing array
		q.items, q.head = q.items[:0], 0
	}
	return j, true
}

// special handles a FIFO, socket or device node: refused with Strict, else dropped,
// counted and logged (a tree has no way to hold it).
func (b *builder) special(path string, mode os.FileMode) error {
	if b.opts.Strict {
		return fmt.Errorf("%s (%s): %w", path, kindOf(mode), ErrSpecialFile)
	}
	b.c.skipped++
	b.c.special++
	log.G(b.ctx).WithField("path", path).WithField("type", kindOf(mode)).Warn("special file left out: trees cannot hold it")
	return nil
}

func kindOf(mode os.FileMode) string {
	switch {
	case mode&os.ModeNamedPipe != 0:
		return "FIFO"
	case mode&os.ModeSocket != 0:
		return "socket"
	case mode&os.ModeCharDevice != 0:
		return "character device"
	case mode&os.ModeDevice != 0:
		return "block device"
	}
	return "special file"
}

// symlink stores a link's target bytes as a blob.
func (b *builder) symlink(path string) (casstore.Hash, error) {
	target, err := os.Readlink(path)
	if err != nil {
		return casstore.Hash{}, fmt.Errorf("read symlink %s: %w", path, err)
	}
	h, err := b.batch.PutBytes([]byte(target))
	if err != nil {
		return casstore.Hash{}, fmt.Errorf("store symlink %s: %w", path, err)
	}
	b.c.symlinks++
	return h, nil
}

// queueFiles hands every regular-file child of n to the workers. It runs once n's
// children slice is final, so the pointers it gives out stay valid.
func (b *builder) queueFiles(n *dirNode) {
	for i := range n.children {
		if c := &n.children[i]; c.file {
			p := c.src
			if p == "" {
				p = childPath(n.path, c.raw)
			}
			b.addFile(p, c.size, &c.hash)
		}
	}
}

// finish writes the tree objects bottom-up and returns the root's hash.
func (b *builder) finish(n *dirNode) (casstore.Hash, error) {
	if err := b.ctx.Err(); err != nil {
		return casstore.Hash{}, err
	}
	entries := make([]casstore.Entry, len(n.children))
	for i := range n.children {
		c := &n.children[i]
		if c.dir != nil {
			h, err := b.finish(c.dir)
			if err != nil {
				return casstore.Hash{}, err
			}
			c.hash = h
		}
		entries[i] = casstore.Entry{Mode: c.mode, Name: c.name, Hash: c.hash}
	}
	h, err := b.batch.WriteTree(entries)
	if err != nil {
		return casstore.Hash{}, fmt.Errorf("write tree for %q: %w", n.path, err)
	}
	return h, nil
}

func childPath(dir, name string) string {
	return dir + string(os.PathSeparator) + name
}

package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"

	"github.com/tidepool-dev/tidepool/casstore"
)

const (
	// commitEvery is how many fetched objects a pull stages before it publishes them,
	// so an interrupted pull keeps most of its work and a re-run fetches only the rest.
	commitEvery = 2048
	// bigEntry is the size above which a pack entry is streamed into the store by
	// the reader instead of being read into memory and handed to a writer.
	bigEntry = 4 << 20
	// packWorthBlobs is how many missing objects (with no missing tree among them)
	// make a pack worth its GET; fewer are fetched one by one.
	packWorthBlobs = 64
)

// PullResult counts a pull.
type PullResult struct {
	Root     casstore.Hash `json:"root"`
	Objects  int64         `json:"objects"` // objects fetched
	Bytes    int64         `json:"bytes"`
	Present  int64         `json:"present"` // objects the store already had
	Requests int64         `json:"requests"`
	Packs    int64         `json:"packs"` // packs read to their end
}

// Pull makes root complete in the local store. It walks root through the local
// store to find what is missing; if that is much, it streams root's pack (one GET,
// see pack.go) and the packs of the roots it was diffed against, storing each
// entry the walk needs once its bytes hash to its name; whatever is still missing
// (no pack, a corrupt or truncated one, objects the packs do not hold) is fetched
// object by object, in parallel. Every object is verified before it is written into
// one store journal (casstore.JournalWriter: entries appended in batches as they
// arrive, kept as the pack's compressed blocks, the journal synced in the background
// as it grows and once at the end), so when Pull returns the root is durable and
// readable through the store, and its objects reach their names in the LunarFS
// layout in the background (Store.WaitPublished, Store.Settle): a pull costs about
// what moving and writing its (compressed) bytes once costs, not one file creation
// per object. Objects
// over bigEntry fetched on their own are staged as files and published in batches.
// An interruption leaves whole objects only: a failed pull commits what its journal
// holds, a killed one leaves a journal the next writer replays, and a re-run fetches
// just the rest.
func (r *Remote) Pull(ctx context.Context, store *casstore.Store, root casstore.Hash) (PullResult, error) {
	before := r.metrics.Snapshot()
	// Into an empty store every object is missing: the walk need not ask for each.
	// (Asked before this pull's own journal exists.)
	empty, err := store.Empty()
	if err != nil {
		return PullResult{Root: root}, err
	}
	j, err := store.BeginJournal()
	if err != nil {
		return PullResult{Root: root}, err
	}
	st, err := newStager(store)
	if err != nil {
		j.Abort()
		return PullResult{Root: root}, err
	}
	p := &puller{r: r, s: store, j: j, st: st, sem: make(chan struct{}, r.conc), empty: empty,
		seen: map[objKey]bool{}, missing: map[objKey]bool{}, inflight: map[casstore.Hash]bool{}}
	g, gctx := errgroup.WithContext(ctx)
	p.g, p.gctx = g, gctx
	err = p.run(ctx, root)
	if werr := g.Wait(); err == nil {
		err = werr
	}
	if cerr := st.finish(); err == nil {
		err = cerr
	}
	// Whatever the journal holds is whole and verified: it is committed after a
	// failed pull too, so a re-run resumes instead of starting over.
	if cerr := j.Commit(); err == nil {
		err = cerr
	}
	after := r.metrics.Snapshot().Sub(before)
	res := PullResult{Root: root, Objects: p.objects.Load(), Bytes: p.bytes.Load(), Present: p.present.Load(),
		Requests: after.Requests, Packs: after.PacksFetched}
	if err != nil {
		return res, fmt.Errorf("pull %s from %s: %w", root, r.loc.url, err)
	}
	log.G(ctx).WithFields(log.Fields{"remote": r.loc.url, "root": root, "objects": res.Objects, "bytes": res.Bytes,
		"packs": res.Packs}).Debug("pulled")
	return res, nil
}

// Hydrate fetches every object of root that store lacks, verified: what a kernel
// view needs before it mounts a root made on another host.
func (r *Remote) Hydrate(ctx context.Context, store *casstore.Store, root casstore.Hash) error {
	_, err := r.Pull(ctx, store, root)
	return err
}

// puller is one pull's state. Every object it meets is in seen; those neither local
// nor fetched yet are in missing. Until direct is set (the pack phase) a missing
// object just waits there for a pack entry; after it, it is fetched at once.
type puller struct {
	r   *Remote
	s   *casstore.Store
	j   *casstore.JournalWriter // where fetched objects go
	st  *stager                 // big objects fetched on their own
	sem chan struct{}
	// empty: the store held no object when the pull began, so an object this pull
	// has not stored is missing (see casstore.Store.Empty).
	empty bool
	g     *errgroup.Group
	gctx  context.Context

	mu       sync.Mutex
	seen     map[objKey]bool
	missing  map[objKey]bool
	inflight map[casstore.Hash]bool // pack entries being stored
	direct   bool

	objects, bytes, present atomic.Int64
}

func (p *puller) run(ctx context.Context, root casstore.Hash) error {
	if err := p.visit(ctx, objKey{root, true}); err != nil {
		return err
	}
	if !p.r.noPacks {
		if err := p.packs(ctx, root); err != nil {
			return err
		}
	}
	p.mu.Lock()
	p.direct = true
	rest := make([]objKey, 0, len(p.missing))
	for k := range p.missing {
		rest = append(rest, k)
	}
	p.mu.Unlock()
	for _, k := range rest {
		p.fetch(k)
	}
	return nil
}

// visit meets object k: present locally (a tree is then walked from disk), or
// missing.
func (p *puller) visit(ctx context.Context, k objKey) error {
	return p.visitKnown(ctx, k, func() (bool, error) { return p.local(k.h) })
}

// visitKnown is visit with the object's presence from have.
func (p *puller) visitKnown(ctx context.Context, k objKey, have func() (bool, error)) error {
	p.mu.Lock()
	if p.seen[k] {
		p.mu.Unlock()
		return nil
	}
	p.seen[k] = true
	p.mu.Unlock()
	ok, err := have()
	if err != nil {
		return err
	}
	if ok {
		p.present.Add(1)
		if !k.tree || k.h == casstore.EmptyHash {
			return nil
		}
		t, err := p.s.ReadTree(k.h)
		if err != nil {
			return err
		}
		return p.expand(ctx, t)
	}
	p.mu.Lock()
	p.missing[k] = true
	direct := p.direct
	p.mu.Unlock()
	if direct {
		p.fetch(k)
	}
	return nil
}

// expand visits a tree's entries, learning which the store has with one HasAll for
// those not seen yet (a tree's entries are met together; one stat each).
func (p *puller) expand(ctx context.Context, t casstore.Tree) error {
	var ask []casstore.Hash
	p.mu.Lock()
	for _, e := range t {
		if e.Hash != casstore.EmptyHash && !p.seen[objKey{e.Hash, e.Mode.IsDir()}] {
			ask = append(ask, e.Hash)
		}
	}
	p.mu.Unlock()
	have := make([]bool, len(ask))
	if !p.empty {
		var err error
		if have, err = p.s.HasAll(ask); err != nil {
			return err
		}
	}
	known := make(map[casstore.Hash]bool, len(ask))
	for i, h := range ask {
		known[h] = have[i]
	}
	for _, e := range t {
		k := objKey{e.Hash, e.Mode.IsDir()}
		ok, asked := known[e.Hash]
		if !asked {
			if err := p.visit(ctx, k); err != nil {
				return err
			}
			continue
		}
		if err := p.visitKnown(ctx, k, func() (bool, error) { return ok, nil }); err != nil {
			return err
		}
	}
	return nil
}

// local reports whether the store has h; H("") is stored without a request.
func (p *puller) local(h casstore.Hash) (bool, error) {
	ok, err := p.s.Has(h)
	if err != nil || ok {
		return ok, err
	}
	if h == casstore.EmptyHash {
		return true, p.j.PutBytesExpect(nil, h)
	}
	return false, nil
}

// got records object h as stored by this pull and walks it if it is a wanted tree.
func (p *puller) got(ctx context.Context, h casstore.Hash, data []byte, n int64) error {
	p.mu.Lock()
	tk := objKey{h, true}
	wantTree := p.missing[tk]
	delete(p.missing, tk)
	delete(p.missing, objKey{h, false})
	delete(p.inflight, h)
	p.mu.Unlock()
	p.objects.Add(1)
	p.bytes.Add(n)
	if !wantTree || h == casstore.EmptyHash {
		return nil
	}
	t, err := casstore.DecodeTree(data)
	if err != nil {
		return fmt.Errorf("tree %s: %w", h, err)
	}
	return p.expand(ctx, t)
}

// gotBlobs is got for blobs (no tree among them), under one lock.
func (p *puller) gotBlobs(objs []casstore.Object) {
	var n int64
	p.mu.Lock()
	for _, o := range objs {
		delete(p.missing, objKey{o.Hash, false})
		delete(p.missing, objKey{o.Hash, true})
		delete(p.inflight, o.Hash)
		n += o.Size
	}
	p.mu.Unlock()
	p.objects.Add(int64(len(objs)))
	p.bytes.Add(n)
}

func (p *puller) acquire(ctx context.Context) error {
	select {
	case p.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *puller) release() { <-p.sem }

// fetch GETs object k on its own, in the background.
func (p *puller) fetch(k objKey) {
	ctx := p.gctx
	p.g.Go(func() error {
		if err := p.acquire(ctx); err != nil {
			return err
		}
		if k.tree {
			b, err := p.r.fetchBytes(ctx, k.h, maxTreeSize)
			p.release()
			if err != nil {
				return err
			}
			if err := p.j.PutBytesExpect(b, k.h); err != nil {
				return err
			}
			return p.got(ctx, k.h, b, int64(len(b)))
		}
		defer p.release()
		rc, err := p.r.Fetch(ctx, k.h)
		if err != nil {
			return err
		}
		defer rc.Close()
		// Up to bigEntry bytes go to the journal (read whole, verified by the reader
		// at its end); a bigger object is staged as a file of its own.
		head, err := io.ReadAll(io.LimitReader(rc, bigEntry+1))
		if err != nil {
			return err
		}
		if len(head) <= bigEntry {
			if err := p.j.PutBytesExpect(head, k.h); err != nil {
				return err
			}
			return p.got(ctx, k.h, nil, int64(len(head)))
		}
		var n int64
		err = p.st.do(0, func(b *casstore.Batch) error {
			var err error
			n, err = b.PutExpect(io.MultiReader(bytes.NewReader(head), rc), k.h)
			return err
		})
		if err != nil {
			return err
		}
		return p.got(ctx, k.h, nil, n)
	})
}

// worthPack says whether what is missing is worth a pack's GET: a missing tree
// (its subtree is unknown, likely large) or many objects.
func (p *puller) worthPack() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.missing) >= packWorthBlobs {
		return true
	}
	for k := range p.missing {
		if k.tree {
			return true
		}
	}
	return false
}

// packs reads root's pack and then the packs of the roots it was diffed against,
// while they still hold what is missing. A pack that cannot be used is logged and
// counted and ends the chain; only local failures (the store) fail the pull.
func (p *puller) packs(ctx context.Context, root casstore.Hash) error {
	want := root
	slabs := newSlabPool(runtime.GOMAXPROCS(0) + 2)
	for depth := 0; depth < maxPackChain && p.worthPack(); depth++ {
		pr, err := p.r.openPack(ctx, want, slabs)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errdefs.IsNotFound(err) {
				log.G(ctx).WithFields(log.Fields{"remote": p.r.loc.url, "pack": p.r.PackKey(want)}).Debug("no pack")
			} else {
				p.r.packFailed(ctx, want, err)
			}
			return nil
		}
		err = p.newPackSink(ctx, slabs).consume(ctx, pr)
		var se storeError
		switch {
		case errors.As(err, &se):
			return se.err
		case err != nil:
			if ctx.Err() != nil {
				return ctx.Err()
			}
			p.r.packFailed(ctx, want, err)
			return nil
		}
		p.r.metrics.packsFetched.Add(1)
		if pr.head.base.IsZero() {
			return nil
		}
		want = pr.head.base
	}
	return nil
}

// storeError is a failure of the local store during a pack's read: it fails the
// pull, where a bad pack only ends the pack phase.
type storeError struct{ err error }

func (e storeError) Error() string { return e.err.Error() }

// packSink stores the entries of one pack that a pull wants. Blobs are gathered per
// slab (see packReader) and, once the reader moves on from their slab, handed as one
// batch to a writer, which verifies them and appends them to the journal where they
// lie (casstore.JournalWriter.PutAllExpect: no copy, a few system calls for hundreds
// of objects) and gives the slab back. Writers run in parallel with the reader, so
// the stream, the hashing and the journal's writes overlap; trees are verified and
// walked by the reader at once, so the entries they name are recognised when they
// come.
type packSink struct {
	p       *puller
	slabs   *slabPool
	pending []casstore.Object // wanted blobs in the current slab
	work    chan packBatch
	wg      sync.WaitGroup
	fatal   atomic.Pointer[error]
	ctx     context.Context
	pr      *packReader
}

// packBatch is the wanted blobs of one slab.
type packBatch struct {
	slab []byte
	objs []casstore.Object
}

func (p *puller) newPackSink(ctx context.Context, slabs *slabPool) *packSink {
	workers := runtime.GOMAXPROCS(0)
	k := &packSink{p: p, slabs: slabs, work: make(chan packBatch, workers), ctx: ctx}
	for w := 0; w < workers; w++ {
		k.wg.Add(1)
		go k.writer()
	}
	return k
}

// retire hands the blobs gathered in slab to a writer, or gives the slab back.
func (k *packSink) retire(slab []byte) {
	if len(k.pending) == 0 {
		k.slabs.put(slab)
		return
	}
	k.work <- packBatch{slab: slab, objs: k.pending}
	k.pending = nil
}

func (k *packSink) setFatal(err error) { k.fatal.CompareAndSwap(nil, &err) }

func (k *packSink) writer() {
	defer k.wg.Done()
	p := k.p
	for b := range k.work {
		if k.fatal.Load() != nil {
			for _, o := range b.objs {
				p.unclaim(o.Hash)
			}
			k.slabs.put(b.slab)
			continue
		}
		refused, err := p.j.PutAllExpect(b.objs)
		if err != nil {
			for _, o := range b.objs {
				p.unclaim(o.Hash)
			}
			k.slabs.put(b.slab)
			k.setFatal(err)
			continue
		}
		bad := make(map[casstore.Hash]bool, len(refused))
		for _, ce := range refused {
			bad[ce.Hash] = true
			p.refuse(k.ctx, k.pr, ce.Hash, ce)
		}
		var n int64
		got := b.objs[:0:0]
		for _, o := range b.objs {
			if !bad[o.Hash] {
				got = append(got, o)
				n += o.Size
			}
		}
		k.slabs.put(b.slab)
		p.r.metrics.objectsFetched.Add(int64(len(got)))
		p.r.metrics.bytesFetched.Add(n)
		p.gotBlobs(got)
	}
}

// consume reads one pack to its end and closes it. Entries the walk needs are
// verified and journaled; the rest are skipped. A corrupt entry is refused and
// counted and stays missing.
func (k *packSink) consume(ctx context.Context, pr *packReader) error {
	k.pr = pr
	pr.retire = k.retire
	err := k.readEntries(ctx, pr)
	// The blobs gathered so far are whole: they go to the writers too.
	pr.Close()
	close(k.work)
	k.wg.Wait()
	if f := k.fatal.Load(); f != nil {
		return storeError{*f}
	}
	return err
}

func (k *packSink) readEntries(ctx context.Context, pr *packReader) error {
	p := k.p
	for {
		if k.fatal.Load() != nil {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		e, ok, err := pr.next()
		if err != nil || !ok {
			return err
		}
		h := e.h
		wantTree, want := p.claim(h)
		if !want {
			if err := pr.skip(e.stored); err != nil {
				return err
			}
			continue
		}
		if e.size > bigEntry && wantTree {
			// A tree this big (stored as it is: next checks) is read whole, to be
			// walked; maxTreeSize bounds it.
			if e.size > maxTreeSize {
				p.unclaim(h)
				return fmt.Errorf("%w: tree %s of %d bytes is larger than the %d allowed", errBadPack, h, e.size, maxTreeSize)
			}
			data := make([]byte, e.size)
			if _, err := io.ReadFull(pr.stream(e.size), data); err != nil {
				p.unclaim(h)
				return pr.short(err)
			}
			if err := k.tree(ctx, pr, h, data); err != nil {
				return err
			}
			continue
		}
		if e.size > bigEntry { // stored as it is (next checks): streamed into the journal
			n := e.size
			start := pr.read
			_, err := p.j.PutExpect(pr.stream(n), h, n)
			var ce *casstore.CorruptError
			switch {
			case pr.read-start < n:
				p.unclaim(h)
				return pr.short(fmt.Errorf("entry %s: %w", h, errors.Join(err, errors.New("unexpected EOF"))))
			case errors.As(err, &ce):
				p.refuse(ctx, pr, h, ce)
				continue
			case err != nil:
				p.unclaim(h)
				return storeError{err}
			}
			if err := p.packGot(ctx, h, nil, n); err != nil {
				return storeError{err}
			}
			continue
		}
		data, err := pr.bytes(e.stored)
		if err != nil {
			p.unclaim(h)
			return err
		}
		if !wantTree {
			k.pending = append(k.pending, casstore.Object{Hash: h, Data: data, Compressed: e.compressed(), Size: e.size})
			continue
		}
		if e.compressed() {
			if data, err = casstore.DecompressObject(data, e.size); err != nil {
				p.refuse(ctx, pr, h, &casstore.CorruptError{Hash: h, Path: pr.key, Reason: err.Error()})
				continue
			}
		}
		if err := k.tree(ctx, pr, h, data); err != nil {
			return err
		}
	}
}

// tree verifies, journals and walks a wanted tree at once, before the entries it
// names are read.
func (k *packSink) tree(ctx context.Context, pr *packReader, h casstore.Hash, data []byte) error {
	p := k.p
	if got := casstore.Sum(data); got != h {
		p.refuse(ctx, pr, h, &casstore.CorruptError{Hash: h, Got: got, Path: pr.key})
		return nil
	}
	if err := p.j.PutBytesExpect(data, h); err != nil {
		p.unclaim(h)
		return storeError{err}
	}
	if err := p.packGot(ctx, h, data, int64(len(data))); err != nil {
		return storeError{err}
	}
	return nil
}

// packGot is got for an object read from a pack, counted as fetched.
func (p *puller) packGot(ctx context.Context, h casstore.Hash, data []byte, n int64) error {
	p.r.metrics.objectsFetched.Add(1)
	p.r.metrics.bytesFetched.Add(n)
	return p.got(ctx, h, data, n)
}

// claim reports whether pack entry h is wanted (and as a tree), and marks it as
// being stored.
func (p *puller) claim(h casstore.Hash) (tree, want bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inflight[h] {
		return false, false
	}
	tree = p.missing[objKey{h, true}]
	want = tree || p.missing[objKey{h, false}]
	if want {
		p.inflight[h] = true
	}
	return tree, want
}

func (p *puller) unclaim(h casstore.Hash) {
	p.mu.Lock()
	delete(p.inflight, h)
	p.mu.Unlock()
}

// refuse drops a pack entry whose bytes do not hash to its name: counted, logged,
// never stored; the object stays missing and is fetched on its own.
func (p *puller) refuse(ctx context.Context, pr *packReader, h casstore.Hash, ce *casstore.CorruptError) {
	p.unclaim(h)
	p.r.metrics.verifyFailures.Add(1)
	log.G(ctx).WithFields(log.Fields{"remote": p.r.loc.url, "pack": pr.key, "object": h}).WithError(ce).
		Warn("refused a pack entry whose bytes are not the object's; fetching the object on its own")
}

// stager spreads a pull's writes over a sequence of batches: every commitEvery
// objects (or commitBytes) the current batch is handed to a committer that
// publishes it (one sync for the batch, then the renames) while the pull goes on
// staging into the next one. Writers share the current batch; a rotation waits for
// them.
type stager struct {
	s     *casstore.Store
	mu    sync.RWMutex
	b     *casstore.Batch
	n     atomic.Int64
	bytes atomic.Int64
	q     chan *casstore.Batch
	done  chan struct{}
	err   error // first commit failure; read after done
}

// commitBytes is the staged size at which a batch is published early.
const commitBytes = 64 << 20

func newStager(s *casstore.Store) (*stager, error) {
	b, err := s.Begin()
	if err != nil {
		return nil, err
	}
	st := &stager{s: s, b: b, q: make(chan *casstore.Batch, 1), done: make(chan struct{})}
	go st.committer()
	return st, nil
}

func (st *stager) committer() {
	defer close(st.done)
	for b := range st.q {
		// After a failure later batches are still published: they hold whole,
		// verified objects, which a re-run then need not fetch.
		if err := b.Commit(); err != nil && st.err == nil {
			st.err = err
		}
	}
}

// do runs fn on the current batch; size is what fn stages, if known (0: unknown).
func (st *stager) do(size int64, fn func(*casstore.Batch) error) error {
	st.mu.RLock()
	b := st.b
	var err error
	if b == nil {
		err = fmt.Errorf("store batch unavailable after an earlier failure")
	} else {
		err = fn(b)
	}
	st.mu.RUnlock()
	if err != nil {
		return err
	}
	if st.n.Add(1)%commitEvery == 0 || st.bytes.Add(size) >= commitBytes {
		return st.rotate()
	}
	return nil
}

func (st *stager) rotate() error {
	st.mu.Lock()
	old := st.b
	if old == nil {
		st.mu.Unlock()
		return fmt.Errorf("store batch unavailable after an earlier failure")
	}
	st.bytes.Store(0)
	nb, err := st.s.Begin()
	st.b = nb
	st.mu.Unlock()
	st.q <- old
	return err
}

// finish publishes what is staged, waits for every batch to be published and
// returns the first failure. Staged objects are whole and verified, so they are
// published after a failed pull too: a re-run resumes instead of starting over.
func (st *stager) finish() error {
	st.mu.Lock()
	old := st.b
	st.b = nil
	st.mu.Unlock()
	if old != nil {
		st.q <- old
	}
	close(st.q)
	<-st.done
	return st.err
}

// FetchInto makes one object local: fetched, verified and stored durably unless the
// store has it already.
func (r *Remote) FetchInto(ctx context.Context, store *casstore.Store, h casstore.Hash) error {
	if ok, err := store.Has(h); err != nil || ok {
		return err
	}
	rc, err := r.Fetch(ctx, h)
	if err != nil {
		return err
	}
	defer rc.Close()
	b, err := store.Begin()
	if err != nil {
		return err
	}
	defer b.Abort()
	if _, err := b.PutExpect(rc, h); err != nil {
		return err
	}
	return b.Commit()
}

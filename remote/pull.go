package remote

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"

	"github.com/tidepool-dev/tidepool/casstore"
)

// commitEvery is how many fetched objects a pull stages before it publishes them, so
// an interrupted pull keeps most of its work and a re-run fetches only the rest.
const commitEvery = 1024

// PullResult counts a pull.
type PullResult struct {
	Root     casstore.Hash `json:"root"`
	Objects  int64         `json:"objects"` // objects fetched
	Bytes    int64         `json:"bytes"`
	Present  int64         `json:"present"` // objects the store already had
	Requests int64         `json:"requests"`
}

// Pull makes root complete in the local store: it walks root's trees (local ones
// from disk, missing ones from the bucket) and fetches every missing object in
// parallel. Each object is hashed while it is staged and refused if it does not
// match its name; staged objects are published in batches through the store's
// durable write path, so an interruption leaves whole objects only.
func (r *Remote) Pull(ctx context.Context, store *casstore.Store, root casstore.Hash) (PullResult, error) {
	before := r.metrics.Snapshot()
	st, err := newStager(store)
	if err != nil {
		return PullResult{Root: root}, err
	}
	p := &puller{r: r, s: store, st: st, sem: make(chan struct{}, r.conc), seen: map[objKey]bool{}}
	g, gctx := errgroup.WithContext(ctx)
	p.g = g
	p.seen[objKey{root, true}] = true
	g.Go(func() error { return p.tree(gctx, root) })
	err = g.Wait()
	if err == nil {
		err = st.commit()
	} else {
		st.abortPending()
	}
	res := PullResult{Root: root, Objects: p.objects.Load(), Bytes: p.bytes.Load(), Present: p.present.Load(),
		Requests: r.metrics.Snapshot().Sub(before).Requests}
	if err != nil {
		return res, fmt.Errorf("pull %s from %s: %w", root, r.loc.url, err)
	}
	log.G(ctx).WithFields(log.Fields{"remote": r.loc.url, "root": root, "objects": res.Objects, "bytes": res.Bytes}).Debug("pulled")
	return res, nil
}

// Hydrate fetches every object of root that store lacks, verified: what a kernel
// view needs before it mounts a root made on another host.
func (r *Remote) Hydrate(ctx context.Context, store *casstore.Store, root casstore.Hash) error {
	_, err := r.Pull(ctx, store, root)
	return err
}

type puller struct {
	r   *Remote
	s   *casstore.Store
	st  *stager
	sem chan struct{}
	g   *errgroup.Group

	mu   sync.Mutex
	seen map[objKey]bool

	objects, bytes, present atomic.Int64
}

func (p *puller) first(k objKey) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.seen[k] {
		return false
	}
	p.seen[k] = true
	return true
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

// local reports whether the store has h; H("") is stored without a request.
func (p *puller) local(h casstore.Hash) (bool, error) {
	ok, err := p.s.Has(h)
	if err != nil || ok {
		return ok, err
	}
	if h == casstore.EmptyHash {
		return true, p.st.do(func(b *casstore.Batch) error { _, err := b.PutBytes(nil); return err })
	}
	return false, nil
}

func (p *puller) tree(ctx context.Context, h casstore.Hash) error {
	t, err := p.loadTree(ctx, h)
	if err != nil {
		return err
	}
	for _, e := range t {
		if !p.first(objKey{e.Hash, e.Mode.IsDir()}) {
			continue
		}
		if e.Mode.IsDir() {
			p.g.Go(func() error { return p.tree(ctx, e.Hash) })
			continue
		}
		ok, err := p.local(e.Hash)
		if err != nil {
			return err
		}
		if ok {
			p.present.Add(1)
			continue
		}
		if err := p.acquire(ctx); err != nil {
			return err
		}
		p.g.Go(func() error {
			defer p.release()
			return p.blob(ctx, e.Hash)
		})
	}
	return nil
}

func (p *puller) loadTree(ctx context.Context, h casstore.Hash) (casstore.Tree, error) {
	ok, err := p.local(h)
	if err != nil {
		return nil, err
	}
	if ok {
		p.present.Add(1)
		return p.s.ReadTree(h)
	}
	if err := p.acquire(ctx); err != nil {
		return nil, err
	}
	b, err := p.r.fetchBytes(ctx, h, maxTreeSize)
	p.release()
	if err != nil {
		return nil, err
	}
	t, err := casstore.DecodeTree(b)
	if err != nil {
		return nil, fmt.Errorf("tree %s: %w", h, err)
	}
	if err := p.st.do(func(b2 *casstore.Batch) error { return b2.PutBytesExpect(b, h) }); err != nil {
		return nil, err
	}
	p.objects.Add(1)
	p.bytes.Add(int64(len(b)))
	return t, nil
}

func (p *puller) blob(ctx context.Context, h casstore.Hash) error {
	rc, err := p.r.Fetch(ctx, h)
	if err != nil {
		return err
	}
	defer rc.Close()
	var n int64
	err = p.st.do(func(b *casstore.Batch) error {
		var err error
		n, err = b.PutExpect(rc, h)
		return err
	})
	if err != nil {
		return err
	}
	p.objects.Add(1)
	p.bytes.Add(n)
	return nil
}

// stager spreads a pull's writes over a sequence of batches, publishing one every
// commitEvery objects. Writers share the current batch; a rotation waits for them.
type stager struct {
	s  *casstore.Store
	mu sync.RWMutex
	b  *casstore.Batch
	n  atomic.Int64
}

func newStager(s *casstore.Store) (*stager, error) {
	b, err := s.Begin()
	if err != nil {
		return nil, err
	}
	return &stager{s: s, b: b}, nil
}

func (st *stager) do(fn func(*casstore.Batch) error) error {
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
	if st.n.Add(1)%commitEvery == 0 {
		return st.rotate()
	}
	return nil
}

func (st *stager) rotate() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.commitLocked(); err != nil {
		return err
	}
	var err error
	st.b, err = st.s.Begin()
	return err
}

func (st *stager) commit() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.commitLocked()
}

func (st *stager) commitLocked() error {
	if st.b == nil {
		return fmt.Errorf("store batch unavailable after an earlier failure")
	}
	err := st.b.Commit()
	st.b = nil
	return err
}

// abortPending publishes what was fetched and verified before a failure, so a re-run
// resumes, and drops nothing half-written: staged objects are whole by construction.
func (st *stager) abortPending() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.b != nil {
		if err := st.b.Commit(); err != nil {
			st.b.Abort()
		}
		st.b = nil
	}
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

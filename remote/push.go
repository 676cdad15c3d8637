package remote

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"

	"github.com/tidepool-dev/tidepool/casstore"
)

// PushOptions says what a push does besides uploading.
type PushOptions struct {
	// Ref, if set, is moved to the pushed root by compare-and-swap.
	Ref string
	// Expect, if non-nil, is the root Ref must still point at (a container's starting
	// root); the ref must exist. Without it the push advances Ref from whatever root
	// it reads, still atomically.
	Expect *casstore.Hash
	// Base is a root the pushed one was made from (e.g. the root a fork was pulled
	// at). If the bucket holds it, the upload diffs against it; a ref's current root
	// is used that way too, and takes precedence.
	Base casstore.Hash
}

// PushResult describes a push.
type PushResult struct {
	Root     casstore.Hash `json:"root"`
	Ref      string        `json:"ref,omitempty"`
	Previous casstore.Hash `json:"previous,omitempty"` // the ref's root before (zero: created)
	Objects  int64         `json:"objects"`            // objects uploaded
	Bytes    int64         `json:"bytes"`
	Requests int64         `json:"requests"` // HTTP requests made, ref operations included
}

// Push uploads root's objects that the bucket lacks and then, if opts.Ref is set,
// moves the ref by compare-and-swap. A lost race keeps root as a conflict ref and
// returns a *ConflictError (errdefs.IsConflict); root is complete in the bucket
// either way.
func (r *Remote) Push(ctx context.Context, store *casstore.Store, root casstore.Hash, opts PushOptions) (PushResult, error) {
	before := r.metrics.Snapshot()
	res := PushResult{Root: root, Ref: opts.Ref}
	finish := func(err error) (PushResult, error) {
		res.Requests = r.metrics.Snapshot().Sub(before).Requests
		return res, err
	}
	var cur Ref
	base := opts.Base
	if opts.Ref != "" {
		if err := CheckRefName(opts.Ref); err != nil {
			return finish(err)
		}
		c, err := r.GetRef(ctx, opts.Ref)
		switch {
		case err == nil:
			cur = c
			base = c.Root // complete in the bucket: a ref is only ever set after its upload
		case !errdefs.IsNotFound(err):
			return finish(err)
		}
	}
	if !base.IsZero() && base != cur.Root {
		// A hint from the caller: trust it only if the bucket holds it, which by the
		// children-first invariant means it holds all of it.
		if ok, err := r.HasBlob(ctx, base); err != nil {
			return finish(err)
		} else if !ok {
			base = casstore.Hash{}
		}
	}
	up, err := r.upload(ctx, store, root, base)
	res.Objects, res.Bytes = up.Objects, up.Bytes
	if err == nil && len(up.uploaded) > 0 && !r.noPacks {
		// Before the ref moves, so a pull by the ref finds it. Only a hint: a push
		// whose pack failed is still whole, and pulls fetch object by object.
		if perr := r.writePack(ctx, store, root, base, up.uploaded); perr != nil {
			log.G(ctx).WithFields(log.Fields{"remote": r.loc.url, "pack": r.PackKey(root)}).WithError(perr).Warn("pack not written")
		}
	}
	if err != nil || opts.Ref == "" {
		return finish(err)
	}
	res.Previous = cur.Root
	if cur.ETag != "" && cur.Root == root {
		return finish(nil) // already there (e.g. a retry of a push that landed)
	}
	if opts.Expect != nil && (cur.ETag == "" || cur.Root != *opts.Expect) {
		return finish(r.conflict(ctx, opts.Ref, root, *opts.Expect, cur.Root))
	}
	err = r.CASRef(ctx, opts.Ref, root, cur)
	if err == nil {
		log.G(ctx).WithFields(log.Fields{"remote": r.loc.url, "ref": opts.Ref, "root": root, "previous": cur.Root}).Info("ref advanced")
	}
	return finish(err)
}

// UploadResult counts an upload.
type UploadResult struct {
	Objects int64
	Bytes   int64
}

// Upload makes root complete in the bucket: every object reachable from it that the
// bucket lacks is uploaded, children before parents, so that a tree's presence in the
// bucket always implies its whole subtree's. Subtrees the bucket holds are skipped
// with one HEAD; entries equal to those of base (a root complete in the bucket, or
// zero) at the same path cost no request at all.
// Upload writes no pack (Push does).
func (r *Remote) Upload(ctx context.Context, store *casstore.Store, root, base casstore.Hash) (UploadResult, error) {
	up, err := r.upload(ctx, store, root, base)
	return up.UploadResult, err
}

type uploadResult struct {
	UploadResult
	uploaded map[casstore.Hash]bool // object -> is a tree
}

func (r *Remote) upload(ctx context.Context, store *casstore.Store, root, base casstore.Hash) (uploadResult, error) {
	if ok, err := store.Has(root); err != nil {
		return uploadResult{}, err
	} else if !ok && root != casstore.EmptyHash {
		return uploadResult{}, fmt.Errorf("root %s is not in the store %s: %w", root, store.Root(), errdefs.ErrNotFound)
	}
	u := &uploader{r: r, s: store, sem: make(chan struct{}, r.conc), calls: map[objKey]*call{}, uploaded: map[casstore.Hash]bool{}}
	err := u.tree(ctx, root, base)
	return uploadResult{UploadResult{Objects: u.objects.Load(), Bytes: u.bytes.Load()}, u.uploaded}, err
}

type objKey struct {
	h    casstore.Hash
	tree bool
}

type call struct {
	done chan struct{}
	err  error
}

type uploader struct {
	r   *Remote
	s   *casstore.Store
	sem chan struct{}

	mu       sync.Mutex
	calls    map[objKey]*call
	uploaded map[casstore.Hash]bool // what this upload wrote (-> is a tree), for the pack

	objects, bytes atomic.Int64
}

// once runs fn for k the first time and makes later callers wait for its result, so
// an object shared by many entries is checked and uploaded once.
func (u *uploader) once(k objKey, fn func() error) error {
	u.mu.Lock()
	if c, ok := u.calls[k]; ok {
		u.mu.Unlock()
		<-c.done
		return c.err
	}
	c := &call{done: make(chan struct{})}
	u.calls[k] = c
	u.mu.Unlock()
	c.err = fn()
	close(c.done)
	return c.err
}

func (u *uploader) acquire(ctx context.Context) error {
	select {
	case u.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (u *uploader) release() { <-u.sem }

func (u *uploader) has(ctx context.Context, h casstore.Hash) (bool, error) {
	if err := u.acquire(ctx); err != nil {
		return false, err
	}
	defer u.release()
	return u.r.HasBlob(ctx, h)
}

func (u *uploader) blob(ctx context.Context, h casstore.Hash) error {
	return u.once(objKey{h, false}, func() error {
		ok, err := u.has(ctx, h)
		if err != nil || ok {
			return err
		}
		if err := u.acquire(ctx); err != nil {
			return err
		}
		defer u.release()
		if h == casstore.EmptyHash {
			return u.count(h, false, 0, u.r.putBytes(ctx, h, nil))
		}
		n, err := u.r.putBlob(ctx, u.s, h)
		return u.count(h, false, n, err)
	})
}

func (u *uploader) count(h casstore.Hash, tree bool, n int64, err error) error {
	if err == nil {
		u.objects.Add(1)
		u.bytes.Add(n)
		u.mu.Lock()
		u.uploaded[h] = u.uploaded[h] || tree
		u.mu.Unlock()
	}
	return err
}

// tree uploads tree h and everything below it that the bucket lacks; old is the tree
// at the same path in a root complete in the bucket (zero if none).
func (u *uploader) tree(ctx context.Context, h, old casstore.Hash) error {
	switch h {
	case old:
		return nil
	case casstore.EmptyHash:
		return u.blob(ctx, h) // the empty tree is the empty blob: one object, no children
	}
	return u.once(objKey{h, true}, func() error {
		ok, err := u.has(ctx, h)
		if err != nil || ok {
			return err // present: so is its whole subtree
		}
		data, err := u.s.ReadAll(h, maxTreeSize)
		if err != nil {
			return err
		}
		t, err := casstore.DecodeTree(data)
		if err != nil {
			return fmt.Errorf("tree %s: %w", h, err)
		}
		ot := u.oldTree(ctx, old)
		g, gctx := errgroup.WithContext(ctx)
		for _, e := range t {
			oe, inOld := ot.Lookup(e.Name)
			if inOld && oe.Hash == e.Hash && oe.Mode.IsDir() == e.Mode.IsDir() {
				continue // unchanged since a root the bucket holds completely
			}
			if e.Mode.IsDir() {
				var oh casstore.Hash
				if inOld && oe.Mode.IsDir() {
					oh = oe.Hash
				}
				g.Go(func() error { return u.tree(gctx, e.Hash, oh) })
			} else {
				g.Go(func() error { return u.blob(gctx, e.Hash) })
			}
		}
		if err := g.Wait(); err != nil {
			return err
		}
		if err := u.acquire(ctx); err != nil {
			return err
		}
		defer u.release()
		return u.count(h, true, int64(len(data)), u.r.putBytes(ctx, h, data))
	})
}

// oldTree reads a base tree from the local store, or else from the bucket. It is
// only a hint: on any failure the upload just asks the bucket about more entries.
func (u *uploader) oldTree(ctx context.Context, h casstore.Hash) casstore.Tree {
	if h.IsZero() || h == casstore.EmptyHash {
		return nil
	}
	if ok, _ := u.s.Has(h); ok {
		if t, err := u.s.ReadTree(h); err == nil {
			return t
		}
	}
	if err := u.acquire(ctx); err != nil {
		return nil
	}
	b, err := u.r.fetchBytes(ctx, h, maxTreeSize)
	u.release()
	if err != nil {
		return nil
	}
	t, err := casstore.DecodeTree(b)
	if err != nil {
		return nil
	}
	return t
}

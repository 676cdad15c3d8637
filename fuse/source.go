package fuse

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/containerd/errdefs"
	"golang.org/x/sync/singleflight"

	"github.com/tidepool-dev/tidepool/casstore"
)

// BlobSource supplies objects that the local store lacks: the seam through which a
// host hydrates forks made elsewhere (a central LunarFS-API store, another node).
// Implementations need not verify what they return; the view does.
type BlobSource interface {
	// Stat returns an object's size without fetching it, so a view can report file
	// sizes before hydrating. An absent object is an error wrapping errdefs.ErrNotFound.
	Stat(ctx context.Context, h casstore.Hash) (int64, error)
	// Fetch streams an object's bytes.
	Fetch(ctx context.Context, h casstore.Hash) (io.ReadCloser, error)
}

// hydrations de-duplicates fetches of one object into one store across every view of
// the process (the key is store root + hash), so 50 concurrent opens cost one fetch.
var hydrations singleflight.Group

// errHydrate marks failures of the fetch-verify-store path.
var errHydrate = errors.New("hydration failed")

// hydrate makes h local: it fetches it from src once, however many callers ask at
// the same time, verifies the bytes while staging them in a batch, and commits only
// if they hash to h. A caller whose request is interrupted stops waiting; the fetch
// itself runs under bg and completes for the others.
func hydrate(ctx, bg context.Context, store *casstore.Store, src BlobSource, h casstore.Hash, stats *Stats) error {
	ch := hydrations.DoChan(store.Root()+"\x00"+h.String(), func() (any, error) {
		return nil, fetchInto(bg, store, src, h, stats)
	})
	select {
	case r := <-ch:
		return r.Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func fetchInto(ctx context.Context, store *casstore.Store, src BlobSource, h casstore.Hash, stats *Stats) error {
	if ok, err := store.Has(h); err == nil && ok {
		return nil // a concurrent flight (or another process) stored it meanwhile
	}
	rc, err := src.Fetch(ctx, h)
	if err != nil {
		return fmt.Errorf("%w: fetch %s: %w", errHydrate, h, err)
	}
	defer rc.Close()
	b, err := store.Begin()
	if err != nil {
		return fmt.Errorf("%w: %w", errHydrate, err)
	}
	defer b.Abort()
	cr := &countingReader{r: rc}
	got, err := b.Put(cr)
	if err != nil {
		return fmt.Errorf("%w: store %s: %w", errHydrate, h, err)
	}
	if got != h {
		return fmt.Errorf("%w: source sent bytes hashing to %s for %s: %w", errHydrate, got, h, errdefs.ErrDataLoss)
	}
	if err := b.Commit(); err != nil {
		return fmt.Errorf("%w: commit %s: %w", errHydrate, h, err)
	}
	stats.Hydrations.Add(1)
	stats.HydratedBytes.Add(uint64(cr.n))
	return nil
}

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

package plugin

import (
	"context"

	"golang.org/x/sync/errgroup"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// RemoteConfig is [remote]: the S3-compatible bucket (LunarFS's server layout) that
// this host shares forks through. Credentials come from the environment.
type RemoteConfig struct {
	URL         string `toml:"url" comment:"Bucket shared by the fleet, s3://BUCKET/PREFIX; empty disables remote: forks, pushes and hydration.\nCredentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in tidepoold's environment."`
	Endpoint    string `toml:"endpoint" comment:"S3 endpoint for MinIO, R2 or RGW: https://HOST[:PORT], or http://HOST:PORT to allow plain HTTP.\nEmpty: AWS_ENDPOINT_URL, then AWS_ENDPOINT (LunarFS's name), then AWS S3."`
	Region      string `toml:"region" comment:"Region requests are signed for; empty: AWS_REGION, then us-east-1."`
	Concurrency int    `toml:"concurrency" comment:"Requests a push or pull keeps in flight."`
	Eager       bool   `toml:"eager" comment:"Fetch every object of a remote fork before its container starts, instead of per file on first open.\nKernel (non-FUSE) views need it; FUSE views fetch lazily."`
}

func (c RemoteConfig) client() remote.Config {
	return remote.Config{URL: c.URL, Endpoint: c.Endpoint, Region: c.Region, Concurrency: c.Concurrency}
}

// remoteForks adapts a remote.Remote to what the snapshotter needs.
type remoteForks struct {
	r     *remote.Remote
	store *casstore.Store
	eager bool
}

var _ snapshotter.Remote = remoteForks{}

func (f remoteForks) ResolveRef(ctx context.Context, name string) (casstore.Hash, error) {
	return f.r.ResolveRef(ctx, name)
}

// EnsureRoot fetches the root tree (a FUSE view fetches the rest on first use) or,
// when eager, every missing object of the root.
func (f remoteForks) EnsureRoot(ctx context.Context, root casstore.Hash) error {
	if f.eager {
		return f.r.Hydrate(ctx, f.store, root)
	}
	return f.r.FetchInto(ctx, f.store, root)
}

func (f remoteForks) Publish(ctx context.Context, ref string, expect, root casstore.Hash) error {
	_, err := f.r.Push(ctx, f.store, root, remote.PushOptions{Ref: ref, Expect: &expect, Base: expect})
	return err
}

// kernelHydrator fetches the objects a kernel view's tree misses from the remote: a
// kernel view shows only local objects, so they are fetched (each verified) before
// the mount, in parallel.
type kernelHydrator struct {
	r     *remote.Remote
	store *casstore.Store
	conc  int
}

func (k kernelHydrator) Hydrate(ctx context.Context, objects []casstore.Hash) error {
	g, ctx := errgroup.WithContext(ctx)
	if k.conc <= 0 {
		k.conc = remote.DefaultConcurrency
	}
	g.SetLimit(k.conc)
	for _, h := range objects {
		g.Go(func() error { return k.r.FetchInto(ctx, k.store, h) })
	}
	return g.Wait()
}

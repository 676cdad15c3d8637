package plugin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/fuse"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// ViewHost serves the snapshotter's fork views from this process: one FUSE server per
// view, all counting into one fuse.Stats.
type ViewHost struct {
	store *casstore.Store
	cfg   ViewsConfig
	stats *fuse.Stats
	// Limits bound each view's directories (set by NewCore from Config.Limits).
	Limits casstore.Limits
	// Source, if set, supplies objects the store lacks (the remote), fetched per
	// file on first use.
	Source fuse.BlobSource

	mu    sync.Mutex
	views map[string]*fuse.View
}

var _ snapshotter.ViewHost = (*ViewHost)(nil)

// NewViewHost returns a host for views of store.
func NewViewHost(store *casstore.Store, cfg ViewsConfig) *ViewHost {
	return &ViewHost{store: store, cfg: cfg, stats: &fuse.Stats{}, views: map[string]*fuse.View{}}
}

func alive(v *fuse.View) bool {
	select {
	case <-v.Done():
		return false
	default:
		return true
	}
}

// Mount implements snapshotter.ViewHost.
func (h *ViewHost) Mount(ctx context.Context, dir string, spec snapshotter.ViewSpec) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if v, ok := h.views[dir]; ok && alive(v) {
		return fmt.Errorf("a view is already mounted at %s: %w", dir, errdefs.ErrAlreadyExists)
	}
	// Whatever a dead server left there would make the mount fail.
	if err := fuse.UnmountStale(dir); err != nil {
		return err
	}
	v, err := fuse.Mount(ctx, h.store, spec.Root, dir, fuse.Options{
		Prefix:             spec.Prefix,
		UID:                spec.UID,
		GID:                spec.GID,
		DisablePassthrough: !h.cfg.Passthrough,
		NoOpen:             h.cfg.NoOpen,
		EntryTimeout:       time.Duration(h.cfg.EntryTimeout),
		AttrTimeout:        time.Duration(h.cfg.AttrTimeout),
		Stats:              h.stats,
		Limits:             h.Limits,
		Source:             h.Source,
	})
	if err != nil {
		return err
	}
	h.views[dir] = v
	return nil
}

// Bind implements snapshotter.ViewHost.
func (h *ViewHost) Bind(_ context.Context, dir string, root casstore.Hash) error {
	h.mu.Lock()
	v, ok := h.views[dir]
	h.mu.Unlock()
	if !ok || !alive(v) {
		return fmt.Errorf("no view is served at %s: %w", dir, errdefs.ErrNotFound)
	}
	if v.Tainted() {
		return fmt.Errorf("the workdir in the view at %s was looked up before the fork was bound, so an overlay above it may have cached it empty: %w", dir, errdefs.ErrFailedPrecondition)
	}
	return v.Bind(root)
}

// Mounted implements snapshotter.ViewHost.
func (h *ViewHost) Mounted(_ context.Context, dir string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	v, ok := h.views[dir]
	return ok && alive(v)
}

// Tainted reports whether the view at dir was looked up before binding.
func (h *ViewHost) Tainted(dir string) (bool, error) {
	h.mu.Lock()
	v, ok := h.views[dir]
	h.mu.Unlock()
	if !ok {
		return false, fmt.Errorf("no view is served at %s: %w", dir, errdefs.ErrNotFound)
	}
	return v.Tainted(), nil
}

// Unmount implements snapshotter.ViewHost.
func (h *ViewHost) Unmount(_ context.Context, dir string) error {
	h.mu.Lock()
	v, ok := h.views[dir]
	h.mu.Unlock()
	if !ok {
		return fuse.UnmountStale(dir)
	}
	if err := v.Unmount(); err != nil {
		return err
	}
	h.mu.Lock()
	delete(h.views, dir)
	h.mu.Unlock()
	return nil
}

// Close unmounts every view as the process ends. A view still in use (a container
// runs on it, or its rootfs is being torn down) is detached lazily: it cannot outlive
// this process anyway, and a detached mount leaves the mount table now.
func (h *ViewHost) Close(ctx context.Context) error {
	h.mu.Lock()
	dirs := make([]string, 0, len(h.views))
	for d := range h.views {
		dirs = append(dirs, d)
	}
	h.mu.Unlock()
	var errs []error
	for _, d := range dirs {
		if err := h.Unmount(ctx, d); err != nil {
			log.G(ctx).WithError(err).WithField("dir", d).Warn("fork view busy at shutdown; detaching it")
			if err := fuse.UnmountStale(d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Collector exports the views' counters to Prometheus.
func (h *ViewHost) Collector() prometheus.Collector { return statsCollector{h} }

type statsCollector struct{ h *ViewHost }

var (
	descOps = prometheus.NewDesc("tidepool_views_operations_total",
		"FUSE operations served by fork views, by operation.", []string{"op"}, nil)
	descErrors = prometheus.NewDesc("tidepool_views_errors_total",
		"Failures served as EIO by fork views, by kind.", []string{"kind"}, nil)
	descHydratedBytes = prometheus.NewDesc("tidepool_views_hydrated_bytes_total",
		"Bytes of objects fetched from the blob source.", nil, nil)
	descMounted = prometheus.NewDesc("tidepool_views_mounted",
		"Fork views currently served by this process.", nil, nil)
)

func (c statsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descOps
	ch <- descErrors
	ch <- descHydratedBytes
	ch <- descMounted
}

func (c statsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.h.stats
	for op, v := range map[string]uint64{
		"lookup": s.Lookups.Load(), "readdir": s.Readdirs.Load(), "open": s.Opens.Load(),
		"passthrough_open": s.PassthroughOpens.Load(), "read": s.Reads.Load(),
		"readlink": s.Readlinks.Load(), "hydration": s.Hydrations.Load(),
	} {
		ch <- prometheus.MustNewConstMetric(descOps, prometheus.CounterValue, float64(v), op)
	}
	for _, k := range fuse.ErrorKinds() {
		ch <- prometheus.MustNewConstMetric(descErrors, prometheus.CounterValue, float64(s.Errors(k)), k.String())
	}
	ch <- prometheus.MustNewConstMetric(descHydratedBytes, prometheus.CounterValue, float64(s.HydratedBytes.Load()))
	c.h.mu.Lock()
	n := len(c.h.views)
	c.h.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(descMounted, prometheus.GaugeValue, float64(n))
}

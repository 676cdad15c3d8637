package plugin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/fuse"
	"github.com/tidepool-dev/tidepool/hostcheck"
	"github.com/tidepool-dev/tidepool/kview"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// View modes (views.mode).
const (
	ModeAuto   = "auto"
	ModeKernel = "kernel"
	ModeFUSE   = "fuse"
)

// KernelProbe says whether kernel views work under a root directory: nil, or an
// error naming what is missing. `tidepool doctor` runs the same checks.
var KernelProbe kview.Prober = func(root string) error {
	return hostcheck.KernelViews(context.Background(), root)
}

// ViewHost serves the snapshotter's fork views, each either as a kernel view (a
// metadata-only EROFS image over the object store, served by the kernel alone, so it
// outlives this process) or by a FUSE server in this process. views.mode chooses:
// "kernel" and "fuse" force one; "auto" takes a kernel view when the kernel supports
// it and every object of the tree is local, FUSE otherwise. Late-bound views (warm
// pool members, whose tree is known only at claim) are always FUSE.
type ViewHost struct {
	store *casstore.Store
	cfg   ViewsConfig
	stats *fuse.Stats
	// Limits bound each view's directories (set by NewCore from Config.Limits).
	Limits casstore.Limits
	// Source, if set, supplies objects the store lacks (the remote), fetched per
	// file on first use.
	Source fuse.BlobSource
	root   string

	kernel    *kview.Host // nil: no kernel views (mode fuse, or auto on a kernel without support)
	kernelErr error       // why kernel is nil in auto mode

	// images is the image cache opened without a kernel host (see imageCache): kernel
	// views mounted by an earlier process or by `tidepool mount` stay mounted whatever
	// mode this process serves, and their objects and images must be kept all the same.
	imagesMu sync.Mutex
	images   *kview.Cache

	mu       sync.Mutex
	views    map[string]*fuse.View
	mounting map[string]bool // directories whose Mount is under way
}

var _ snapshotter.ViewHost = (*ViewHost)(nil)

// NewViewHost returns a host for views of store whose state (the kernel views' image
// cache) lives under root. In kernel mode it fails if the kernel cannot serve views.
func NewViewHost(store *casstore.Store, cfg ViewsConfig, root string) (*ViewHost, error) {
	h := &ViewHost{store: store, cfg: cfg, stats: &fuse.Stats{}, root: root, views: map[string]*fuse.View{}}
	mode := cfg.Mode
	if mode == "" {
		mode = ModeAuto
	}
	switch mode {
	case ModeFUSE:
		return h, nil
	case ModeAuto, ModeKernel:
	default:
		return nil, fmt.Errorf("config: views.mode %q: want %q, %q or %q: %w", cfg.Mode, ModeAuto, ModeKernel, ModeFUSE, errdefs.ErrInvalidArgument)
	}
	dir := filepath.Join(root, "kview")
	if err := KernelProbe(dir); err != nil {
		if mode == ModeKernel {
			return nil, fmt.Errorf("config: views.mode = %q: %w", mode, err)
		}
		if errors.Is(err, hostcheck.ErrRootFull) {
			// Not what the host is but a fault of the moment, which lasts for
			// this process: it probes once.
			log.L.WithError(err).Warn("kernel fork views unavailable until tidepoold restarts with space on its root; serving every view with FUSE")
		} else {
			log.L.WithError(err).Info("kernel fork views unavailable; serving every view with FUSE")
		}
		h.kernelErr = err
		return h, nil
	}
	k, err := kview.NewHost(store, filepath.Join(dir, "images"))
	if err != nil {
		return nil, err
	}
	k.ColdReadAhead = cfg.ColdReadAheadMB << 20
	h.kernel = k
	return h, nil
}

// Mode describes the views this host serves, for operators (tidepoold's state file,
// `tidepool doctor`): "kernel" or "fuse" when forced, "auto (kernel)" when kernel
// views are in use for trees whose objects are all local, "auto (fuse: REASON)" when
// the kernel cannot serve them.
func (h *ViewHost) Mode() string {
	switch {
	case h.cfg.Mode == ModeKernel || h.cfg.Mode == ModeFUSE:
		return h.cfg.Mode
	case h.kernel != nil:
		return ModeAuto + " (kernel)"
	default:
		return fmt.Sprintf("%s (fuse: %v)", ModeAuto, h.kernelErr)
	}
}

// Kernel returns the kernel view host, nil when kernel views are not in use.
func (h *ViewHost) Kernel() *kview.Host { return h.kernel }

// imageCache returns the kernel views' image cache under the root: the kernel host's,
// or, when this process serves no kernel views (views.mode = "fuse", or a kernel
// probe that failed at start), one opened on the same directory, so that the kernel
// views still mounted from it (adopted after a restart, or mounted by `tidepool
// mount`) keep their objects and images. nil when no image was ever built here.
func (h *ViewHost) imageCache() (*kview.Cache, error) {
	if h.kernel != nil {
		return h.kernel.Cache(), nil
	}
	h.imagesMu.Lock()
	defer h.imagesMu.Unlock()
	if h.images != nil {
		return h.images, nil
	}
	dir := filepath.Join(h.root, "kview", "images")
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil, nil // looked for again next time: `tidepool mount` may build one
	} else if err != nil {
		return nil, fmt.Errorf("kernel view image cache: %w", err)
	}
	c, err := kview.NewCache(dir, h.store, nil)
	if err != nil {
		return nil, err
	}
	h.images = c
	return c, nil
}

// KernelRoots are the roots shown by mounted kernel views, which garbage collection
// must keep whatever else references them, in every view mode.
func (h *ViewHost) KernelRoots() ([]casstore.Hash, error) {
	c, err := h.imageCache()
	if c == nil || err != nil {
		return nil, err
	}
	return c.MountedRoots()
}

// CollectImages removes cached kernel view images no mounted view has used for
// kview.DefaultGrace.
func (h *ViewHost) CollectImages(ctx context.Context) {
	c, err := h.imageCache()
	if c == nil {
		if err != nil {
			log.G(ctx).WithError(err).Warn("collecting kernel view images failed")
		}
		return
	}
	if n, err := c.Collect(ctx, kview.DefaultGrace); err != nil {
		log.G(ctx).WithError(err).Warn("collecting kernel view images failed")
	} else if n > 0 {
		log.G(ctx).WithField("images", n).Debug("collected unused kernel view images")
	}
}

// mountKernel tries a kernel view at dir; ok is false when the view should be served
// with FUSE instead (auto mode only).
func (h *ViewHost) mountKernel(ctx context.Context, dir string, spec snapshotter.ViewSpec) (ok bool, err error) {
	if h.kernel == nil || spec.Root.IsZero() {
		return false, nil
	}
	mount := h.kernel.Mount
	if spec.Image {
		mount = h.kernel.MountImage
	}
	err = mount(ctx, dir, kview.Spec{Root: spec.Root, Prefix: spec.Prefix, UID: spec.UID, GID: spec.GID})
	if err == nil {
		return true, nil
	}
	if h.cfg.Mode == ModeKernel {
		return false, err
	}
	lg := log.G(ctx).WithError(err).WithField("dir", dir).WithField("root", spec.Root.Short())
	if errdefs.IsNotFound(err) {
		lg.Info("tree not entirely local; serving its view with FUSE")
	} else {
		lg.Warn("kernel view failed; serving it with FUSE")
	}
	return false, nil
}

// Prebuild implements snapshotter.ViewHost: it builds a kernel view's image ahead of
// its Mount (see kview.Host.Prebuild) when the view will be a kernel one; otherwise it
// does nothing. In auto mode a tree
// with objects missing is left to Mount, which serves it with FUSE.
func (h *ViewHost) Prebuild(ctx context.Context, spec snapshotter.ViewSpec) error {
	if h.kernel == nil || spec.Root.IsZero() {
		return nil
	}
	return h.kernel.Prebuild(ctx, kview.Spec{Root: spec.Root, Prefix: spec.Prefix, UID: spec.UID, GID: spec.GID})
}

// warmRoots is how many of the roots shown last a starting host decodes the trees of.
const warmRoots = 4

// WarmUp implements snapshotter.ViewHost: a kernel host decodes the trees of the
// roots its cached images showed last (see kview.Cache.WarmTrees), so that the
// first new images after a start are built as fast as later ones.
func (h *ViewHost) WarmUp(ctx context.Context) error {
	if h.kernel == nil {
		return nil
	}
	start := time.Now()
	n, err := h.kernel.WarmTrees(ctx, warmRoots)
	log.G(ctx).WithField("trees", n).WithField("took", time.Since(start).Round(time.Millisecond)).Debug("decoded the trees of recent kernel views")
	return err
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
// Views of different directories are mounted in parallel (a burst of pool claims
// mounts one each): the host's lock covers its maps, not the mounts.
func (h *ViewHost) Mount(ctx context.Context, dir string, spec snapshotter.ViewSpec) error {
	h.mu.Lock()
	if v, ok := h.views[dir]; ok && alive(v) || h.mounting[dir] {
		h.mu.Unlock()
		return fmt.Errorf("a view is already mounted at %s: %w", dir, errdefs.ErrAlreadyExists)
	}
	if h.mounting == nil {
		h.mounting = map[string]bool{}
	}
	h.mounting[dir] = true
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		delete(h.mounting, dir)
		h.mu.Unlock()
	}()
	if kview.IsMounted(dir) {
		return fmt.Errorf("a view is already mounted at %s: %w", dir, errdefs.ErrAlreadyExists)
	}
	// Whatever a dead server left there would make the mount fail.
	if err := fuse.UnmountStale(dir); err != nil {
		return err
	}
	if ok, err := h.mountKernel(ctx, dir, spec); ok || err != nil {
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
	h.mu.Lock()
	h.views[dir] = v
	h.mu.Unlock()
	return nil
}

// Bind implements snapshotter.ViewHost.
func (h *ViewHost) Bind(_ context.Context, dir string, root casstore.Hash) error {
	h.mu.Lock()
	v, ok := h.views[dir]
	h.mu.Unlock()
	if !ok || !alive(v) {
		if kview.IsMounted(dir) {
			return fmt.Errorf("the view at %s is a kernel view, which shows its tree from mount on and cannot be bound later: %w", dir, errdefs.ErrFailedPrecondition)
		}
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
	v, ok := h.views[dir]
	h.mu.Unlock()
	return ok && alive(v) || kview.IsMounted(dir)
}

// Tainted reports whether the view at dir was looked up before binding.
func (h *ViewHost) Tainted(dir string) (bool, error) {
	h.mu.Lock()
	v, ok := h.views[dir]
	h.mu.Unlock()
	if !ok {
		if kview.IsMounted(dir) {
			return false, nil // bound at mount: nothing could look it up unbound
		}
		return false, fmt.Errorf("no view is served at %s: %w", dir, errdefs.ErrNotFound)
	}
	return v.Tainted(), nil
}

// Unmount implements snapshotter.ViewHost. Unmounting a kernel view leaves the
// containers using it working (overlayfs holds its layers); its image is collected
// once no view uses it.
func (h *ViewHost) Unmount(ctx context.Context, dir string) error {
	h.mu.Lock()
	v, ok := h.views[dir]
	h.mu.Unlock()
	if !ok {
		if kview.IsMounted(dir) {
			if err := kview.UnmountDir(dir); err != nil {
				return err
			}
			h.CollectImages(ctx)
			return nil
		}
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

// ImageLayer implements snapshotter.ViewHost: a kernel view's image mounted alone
// (kview.Host.MountImage, possibly by an earlier process) points into the store.
func (h *ViewHost) ImageLayer(dir string) (string, bool, error) {
	m, err := kview.MountedAt(dir)
	if err != nil || m == nil || !m.Image {
		return "", false, err
	}
	return h.store.Root(), true, nil
}

// Close unmounts every FUSE view as the process ends. A view still in use (a
// container runs on it, or its rootfs is being torn down) is detached lazily: it
// cannot outlive this process anyway, and a detached mount leaves the mount table now.
// Kernel views stay mounted: they need no process, and the next start adopts them.
func (h *ViewHost) Close(ctx context.Context) error {
	if h.kernel != nil {
		h.kernel.Close()
	}
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
		"Fork views currently mounted for the snapshotter, by mode (fuse: served by this process; kernel: EROFS + overlayfs).", []string{"mode"}, nil)
	descImageBuilds = prometheus.NewDesc("tidepool_views_image_builds_total",
		"Kernel view images built from a scan of their tree.", nil, nil)
	descImageDerived = prometheus.NewDesc("tidepool_views_image_derived_total",
		"Kernel view images derived from a cached image of the same tree for another owner.", nil, nil)
	descImageSeconds = prometheus.NewDesc("tidepool_views_image_build_seconds_total",
		"Time spent building and deriving kernel view images.", nil, nil)
	descImageBytes = prometheus.NewDesc("tidepool_views_image_bytes_total",
		"Bytes of kernel view images built and derived.", nil, nil)
	descImageHits = prometheus.NewDesc("tidepool_views_image_cache_hits_total",
		"Kernel view mounts that found their image already built.", nil, nil)
	descObjectChecks = prometheus.NewDesc("tidepool_views_image_object_checks_total",
		"Object lists of cached kernel view images checked against the store (a cache hit skips it while the size index has forgotten nothing since the list was last found whole in it).", nil, nil)
	descTreesRead = prometheus.NewDesc("tidepool_views_image_trees_read_total",
		"Tree objects that kernel view image builds read from the store (the others were decoded before).", nil, nil)
	descTreesWarmed = prometheus.NewDesc("tidepool_views_trees_warmed_total",
		"Tree objects decoded at start from the roots of the kernel views shown last.", nil, nil)
	descColdReadAheads = prometheus.NewDesc("tidepool_views_cold_read_aheads_total",
		"Kernel views mounted onto cold caches (their image was not in the page cache) whose files' data was read ahead.", nil, nil)
	descColdReadAheadBytes = prometheus.NewDesc("tidepool_views_cold_read_ahead_bytes_total",
		"Bytes of objects read ahead for kernel views mounted onto cold caches (views.cold_read_ahead_mb).", nil, nil)
)

func (c statsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descOps
	ch <- descErrors
	ch <- descHydratedBytes
	ch <- descMounted
	ch <- descImageBuilds
	ch <- descImageSeconds
	ch <- descImageBytes
	ch <- descImageHits
	ch <- descObjectChecks
	ch <- descImageDerived
	ch <- descTreesRead
	ch <- descTreesWarmed
	ch <- descColdReadAheads
	ch <- descColdReadAheadBytes
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
	ch <- prometheus.MustNewConstMetric(descMounted, prometheus.GaugeValue, float64(n), ModeFUSE)
	k := c.h.kernel
	if k == nil {
		ch <- prometheus.MustNewConstMetric(descMounted, prometheus.GaugeValue, 0, ModeKernel)
		return
	}
	if kv, err := kview.List(filepath.Join(c.h.root, "views")); err == nil {
		ch <- prometheus.MustNewConstMetric(descMounted, prometheus.GaugeValue, float64(len(kv)), ModeKernel)
	}
	ks := k.Stats()
	ch <- prometheus.MustNewConstMetric(descImageBuilds, prometheus.CounterValue, float64(ks.Builds.Load()))
	ch <- prometheus.MustNewConstMetric(descImageSeconds, prometheus.CounterValue, time.Duration(ks.BuildNanos.Load()).Seconds())
	ch <- prometheus.MustNewConstMetric(descImageBytes, prometheus.CounterValue, float64(ks.BuildBytes.Load()))
	ch <- prometheus.MustNewConstMetric(descImageHits, prometheus.CounterValue, float64(ks.CacheHits.Load()))
	ch <- prometheus.MustNewConstMetric(descObjectChecks, prometheus.CounterValue, float64(ks.ObjectChecks.Load()))
	ch <- prometheus.MustNewConstMetric(descImageDerived, prometheus.CounterValue, float64(ks.Derived.Load()))
	ch <- prometheus.MustNewConstMetric(descTreesRead, prometheus.CounterValue, float64(ks.TreesRead.Load()))
	ch <- prometheus.MustNewConstMetric(descTreesWarmed, prometheus.CounterValue, float64(ks.TreesWarmed.Load()))
	ch <- prometheus.MustNewConstMetric(descColdReadAheads, prometheus.CounterValue, float64(ks.ColdReadAheads.Load()))
	ch <- prometheus.MustNewConstMetric(descColdReadAheadBytes, prometheus.CounterValue, float64(ks.ColdReadAheadBytes.Load()))
}

package plugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/casstore/gc"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// Core is Tidepool's assembled state for one root: the object store, the fork
// database, the host serving fork views and the snapshotter. Both hosts (tidepoold and
// a containerd built-in) build exactly one per process.
type Core struct {
	Config      *Config
	Store       *casstore.Store
	Forks       *forks.DB
	Views       *ViewHost
	Snapshotter *snapshotter.Snapshotter
	// Remote is the shared bucket ([remote]); nil when none is configured.
	Remote *remote.Remote

	gc     *gcMetrics
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
}

// realRoot creates root if it is missing (0700, as the store would) and returns its
// real path. Everything under the root is found again in the kernel's mount table
// (views adopted after a restart, a view's or a slot's stack, what a dead process left
// mounted), which names real paths: a root configured through a symbolic link (a
// /var/lib that links to a data disk) must be used by the path the table shows.
func realRoot(root string) (string, error) {
	if err := os.MkdirAll(root, 0o700); err != nil {
		return "", fmt.Errorf("create root %s: %w", root, err)
	}
	real, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", fmt.Errorf("resolve root %s: %w", root, err)
	}
	return real, nil
}

// NewCore opens everything under cfg.Root and starts background upkeep.
func NewCore(ctx context.Context, cfg *Config) (_ *Core, retErr error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	root, err := realRoot(cfg.Root)
	if err != nil {
		return nil, err
	}
	if err := checkLayerPath("root", root); err != nil {
		return nil, fmt.Errorf("%w (its real path)", err)
	}
	cfg.Root = root
	uid, gid, _ := binding.ParseOwner(cfg.Snapshotter.DefaultOwner)
	store, err := casstore.Open(cfg.StorePath())
	if err != nil {
		return nil, err
	}
	// Before anything reads the store: objects a journal of a dead writer holds are
	// made whole again (see casstore's journal.go).
	if n, err := store.ReplayDeadJournals(); err != nil {
		return nil, fmt.Errorf("replay store journals: %w", err)
	} else if n > 0 {
		log.G(ctx).WithField("objects", n).Warn("restored objects from journals left by dead writers")
	}
	if n, err := store.SweepDeadTemp(); err != nil {
		log.G(ctx).WithError(err).Warn("removing temp files left by dead writers failed")
	} else if n > 0 {
		log.G(ctx).WithField("files", n).Info("removed temp files left by dead writers")
	}
	db, err := forks.OpenDB(filepath.Join(cfg.Root, "forks.db"), 5*time.Second)
	if err != nil {
		return nil, err
	}
	db.SetGuard(store) // records of roots and gc's sweep exclude each other
	defer func() {
		if retErr != nil {
			db.Close()
		}
	}()
	views, err := NewViewHost(store, cfg.Views, cfg.Root)
	if err != nil {
		return nil, err
	}
	views.Limits = cfg.Limits
	var rm *remote.Remote
	var rf snapshotter.Remote
	if cfg.Remote.URL != "" {
		if rm, err = remote.Open(cfg.Remote.client()); err != nil {
			return nil, fmt.Errorf("config: remote: %w", err)
		}
		views.Source = rm
		rf = remoteForks{r: rm, store: store, eager: cfg.Remote.Eager}
		// In kernel mode a remote tree is fetched before its mount (only what is
		// missing); auto serves it lazily through FUSE unless [remote] eager fetched it.
		if k := views.Kernel(); k != nil && cfg.Views.Mode == ModeKernel {
			k.Hydrator = kernelHydrator{r: rm, store: store, conc: cfg.Remote.Concurrency}
		}
	}
	sn, err := snapshotter.New(ctx, snapshotter.Config{
		Root:         cfg.Root,
		MountOptions: cfg.Snapshotter.MountOptions,
		AsyncRemove:  !cfg.Snapshotter.SyncRemove,
		Defaults:     binding.Defaults{Workdir: cfg.Snapshotter.DefaultWorkdir, UID: uid, GID: gid},
		Remote:       rf,
		ViewLayering: cfg.Views.Layering,
	}, store, db, views)
	if err != nil {
		return nil, err
	}
	bg, cancel := context.WithCancel(context.WithoutCancel(ctx))
	c := &Core{Config: cfg, Store: store, Forks: db, Views: views, Snapshotter: sn, Remote: rm, gc: newGCMetrics(), cancel: cancel}
	views.CollectImages(ctx) // images of views that went while no daemon ran
	c.every(bg, time.Duration(cfg.Maintenance.ForkSweepInterval), c.sweepForks)
	c.every(bg, time.Hour, c.sweepTemp)
	c.every(bg, time.Duration(cfg.Maintenance.GCInterval), c.collectGarbage)
	return c, nil
}

// collectGarbage deletes objects no fork, pin or active snapshot (snapshots pin
// their roots) reaches, keeping anything written within the grace period.
func (c *Core) collectGarbage(ctx context.Context) {
	kernelRoots, err := c.Views.KernelRoots()
	if err != nil {
		c.gc.runs.WithLabelValues("skipped").Inc()
		log.G(ctx).WithError(err).Warn("garbage collection skipped: cannot list the roots of mounted kernel views")
		return
	}
	c.gc.viewRoots.Set(float64(len(kernelRoots)))
	res, err := gc.Collect(ctx, c.Store, c.Forks, gc.Options{Grace: time.Duration(c.Config.Maintenance.GCGrace), Roots: kernelRoots})
	if err != nil {
		c.gc.runs.WithLabelValues("failed").Inc()
		log.G(ctx).WithError(err).Warn("garbage collection failed")
		return
	}
	c.gc.runs.WithLabelValues("ok").Inc()
	c.gc.swept.Add(float64(res.Swept))
	c.gc.freed.Add(float64(res.BytesFreed))
	log.G(ctx).WithField("swept", res.Swept).WithField("bytes", res.BytesFreed).WithField("marked", res.Marked).Info("garbage collected")
}

// every runs fn each interval until the core closes; a zero interval disables it.
func (c *Core) every(ctx context.Context, interval time.Duration, fn func(context.Context)) {
	if interval <= 0 {
		return
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			fn(ctx)
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
}

func (c *Core) sweepForks(ctx context.Context) {
	gone, err := c.Forks.Sweep(time.Now())
	if err != nil {
		log.G(ctx).WithError(err).Warn("fork TTL sweep failed")
	} else if len(gone) > 0 {
		log.G(ctx).WithField("forks", gone).Info("removed forks whose TTL ran out")
	}
}

func (c *Core) sweepTemp(ctx context.Context) {
	if n, err := c.Store.SweepTemp(time.Duration(c.Config.Maintenance.GCGrace)); err != nil {
		log.G(ctx).WithError(err).Warn("sweeping stale temp files failed")
	} else if n > 0 {
		log.G(ctx).WithField("files", n).Info("removed stale temp files")
	}
}

// Collectors are the Prometheus collectors of the core's components.
func (c *Core) Collectors() []prometheus.Collector {
	cs := append([]prometheus.Collector{c.Snapshotter.Metrics(), c.Views.Collector()}, c.gc.collectors()...)
	if c.Remote != nil {
		cs = append(cs, c.Remote.Metrics())
	}
	return cs
}

// Close stops upkeep, unmounts every view this process serves and closes the
// databases. Committed data is already durable.
func (c *Core) Close() error {
	var err error
	c.once.Do(func() {
		c.cancel()
		c.wg.Wait()
		c.Store.Settle() // journaled branches made durable in place, their journals gone
		err = errors.Join(
			c.Snapshotter.Close(),
			c.Views.Close(context.Background()),
			c.Forks.Close(),
		)
		if err != nil {
			err = fmt.Errorf("close tidepool core: %w", err)
		}
	})
	return err
}

package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// Container labels that make a member findable with ctr and after a restart.
const (
	LabelPool    = "dev.tidepool.pool"
	LabelMember  = "dev.tidepool.member"
	LabelState   = "dev.tidepool.member-state"
	LabelCreated = "dev.tidepool.member-created"
)

// Member states, as recorded in LabelState.
const (
	stateIdle    = "idle"
	stateClaimed = "claimed"
)

// Config configures the controller.
type Config struct {
	// ContainerdAddress and Namespace locate the containerd the members live in.
	ContainerdAddress string
	Namespace         string
	// StateDir holds one control directory per member.
	StateDir string
	// Holder is the tidepool-holder binary, bind-mounted read-only into members.
	Holder string
	// ShimConfig, if set, is passed to the tidepool shim as its config path.
	ShimConfig string
	// Snapshotter is the name containerd knows the tidepool snapshotter by.
	Snapshotter string
	Templates   []Template
}

// Snapshots is what the pools need from the tidepool snapshotter (which
// *snapshotter.Snapshotter is): the member snapshots' keys and state, and binding,
// re-keying and committing them.
type Snapshots interface {
	KeyFromMounts(ctx context.Context, mounts []mount.Mount) (string, error)
	Stat(ctx context.Context, key string) (snapshots.Info, error)
	CheckLateBind(ctx context.Context, key string) error
	Rekey(ctx context.Context, from, to string) error
	Bind(ctx context.Context, req snapshotter.BindRequest) (snapshotter.BindResult, error)
	CommitNow(ctx context.Context, key string) (forkID string, root casstore.Hash, err error)
}

// Controller keeps every pool at its target and serves claims.
type Controller struct {
	cfg     Config
	sn      Snapshots
	cgroups cgroupHost
	metrics *Metrics
	// newMember starts one member of a pool in containerd ((*Pool).create); tests
	// replace it.
	newMember func(*Pool, context.Context) (*Member, error)

	pools map[string]*Pool

	mu        sync.Mutex
	client    *containerd.Client
	adoptions map[string]*adopted // by member id
	ready     chan struct{}       // closed once connected and reconciled

	cancel context.CancelFunc
	wg     sync.WaitGroup
	// teardowns are the claimed members being destroyed after their result went out;
	// Stop waits for them.
	teardowns sync.WaitGroup
}

// NewController checks the templates; Start connects to containerd.
func NewController(cfg Config, sn Snapshots) (*Controller, error) {
	if cfg.Namespace == "" {
		cfg.Namespace = "tidepool"
	}
	if cfg.Snapshotter == "" {
		cfg.Snapshotter = "tidepool"
	}
	c := &Controller{cfg: cfg, sn: sn, cgroups: v1Cgroups{}, metrics: newMetrics(), pools: map[string]*Pool{}, ready: make(chan struct{}),
		newMember: (*Pool).create}
	for i := range cfg.Templates {
		t := cfg.Templates[i]
		if err := t.Validate(); err != nil {
			return nil, err
		}
		if _, dup := c.pools[t.Name]; dup {
			return nil, fmt.Errorf("pool %q is configured twice", t.Name)
		}
		c.pools[t.Name] = newPool(c, t)
	}
	if len(c.pools) > 0 {
		if _, err := os.Stat(cfg.Holder); err != nil {
			return nil, fmt.Errorf("pool holder binary: %w", err)
		}
		// Member control directories live here; nobody but root may reach them.
		if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
			return nil, fmt.Errorf("pool state dir: %w", err)
		}
		if err := os.Chown(cfg.StateDir, os.Geteuid(), os.Getegid()); err != nil {
			return nil, fmt.Errorf("pool state dir: %w", err)
		}
		if err := os.Chmod(cfg.StateDir, 0o700); err != nil {
			return nil, fmt.Errorf("pool state dir: %w", err)
		}
	}
	return c, nil
}

// Metrics exposes the pools' collectors.
func (c *Controller) Metrics() *Metrics { return c.metrics }

// Start connects to containerd in the background (retrying until it answers),
// reconciles the members it finds, and keeps every pool at target.
func (c *Controller) Start(ctx context.Context) {
	if len(c.pools) == 0 {
		close(c.ready)
		return
	}
	ctx, c.cancel = context.WithCancel(namespaces.WithNamespace(context.WithoutCancel(ctx), c.cfg.Namespace))
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		if err := c.connect(ctx); err != nil {
			return
		}
		c.reconcile(ctx)
		close(c.ready)
		for _, p := range c.pools {
			c.wg.Add(1)
			go func(p *Pool) {
				defer c.wg.Done()
				p.maintain(ctx)
			}(p)
		}
	}()
}

func (c *Controller) connect(ctx context.Context) error {
	for {
		cl, err := containerd.New(c.cfg.ContainerdAddress, containerd.WithDefaultNamespace(c.cfg.Namespace))
		if err == nil {
			if _, err = cl.Version(ctx); err == nil {
				c.mu.Lock()
				c.client = cl
				c.mu.Unlock()
				return nil
			}
			cl.Close()
		}
		log.G(ctx).WithError(err).Debug("pools: containerd not reachable yet")
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// Stop stops refilling. Idle members stay, frozen, for the next start to adopt.
func (c *Controller) Stop() {
	if c.cancel != nil {
		c.cancel()
	}
	c.wg.Wait()
	c.teardowns.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.client != nil {
		c.client.Close()
	}
}

// Status is one pool's state.
type Status struct {
	Name                    string
	Image                   string
	Idle, Claimed, Starting int
	Min, Target, Max        int
}

// List reports every pool.
func (c *Controller) List() []Status {
	var out []Status
	for _, p := range c.pools {
		p.mu.Lock()
		out = append(out, Status{Name: p.t.Name, Image: p.t.Image, Idle: len(p.idle), Claimed: p.claimed, Starting: p.starting,
			Min: p.t.Min, Target: p.t.Target, Max: p.t.Max})
		p.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func (c *Controller) pool(name string) (*Pool, error) {
	p, ok := c.pools[name]
	if !ok {
		names := make([]string, 0, len(c.pools))
		for n := range c.pools {
			names = append(names, n)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("no pool %q (configured: %s): %w", name, strings.Join(names, ", "), errdefs.ErrNotFound)
	}
	return p, nil
}

func (c *Controller) waitReady(ctx context.Context) error {
	select {
	case <-c.ready:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pools are not ready (is containerd reachable at %s?): %w", c.cfg.ContainerdAddress, ctx.Err())
	}
}

// nsContext puts the members' containerd namespace on a caller's context.
func (c *Controller) nsContext(ctx context.Context) context.Context {
	return namespaces.WithNamespace(ctx, c.cfg.Namespace)
}

func (c *Controller) containerd() *containerd.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.client
}

// reconcile deals with the members a previous tidepoold left: claimed ones are
// finished (their workload's changes are committed when it exits), everything else is
// destroyed and the pools refill, so nothing leaks.
func (c *Controller) reconcile(ctx context.Context) {
	cl := c.containerd()
	list, err := cl.Containers(ctx, fmt.Sprintf("labels.%q", LabelPool))
	if err != nil {
		log.G(ctx).WithError(err).Warn("pools: cannot list members to reconcile")
		return
	}
	known := map[string]bool{}
	for _, ctr := range list {
		known[ctr.ID()] = true
		labels, err := ctr.Labels(ctx)
		if err != nil {
			continue
		}
		logger := log.G(ctx).WithField("member", ctr.ID())
		p := c.pools[labels[LabelPool]]
		if p == nil {
			logger.Info("pools: destroying a member of a pool that is no longer configured")
			c.destroyContainer(ctx, ctr)
			continue
		}
		if by := labels[LabelAdoptedBy]; by != "" {
			// A container's shim drives this member through us; take up the
			// bookkeeping so its calls (wait, kill, release) work again.
			if m, err := p.reattach(ctx, ctr, labels); err == nil {
				ad := &adopted{m: m, container: by, done: make(chan struct{})}
				ad.watch()
				c.mu.Lock()
				if c.adoptions == nil {
					c.adoptions = map[string]*adopted{}
				}
				c.adoptions[m.id] = ad
				c.mu.Unlock()
				p.mu.Lock()
				p.claimed++
				p.mu.Unlock()
				logger.WithField("container", by).Info("pools: re-attached a member adopted by a container")
				continue
			}
		}
		m, err := p.adopt(ctx, ctr, labels)
		if err != nil {
			logger.WithError(err).Info("pools: destroying a member left by the previous tidepoold")
			c.metrics.discarded.WithLabelValues(p.t.Name, "daemon_restart").Inc()
			c.destroyContainer(ctx, ctr)
			continue
		}
		logger.Info("pools: a claimed member outlived its client; committing when its workload exits")
		p.mu.Lock()
		p.claimed++
		p.mu.Unlock()
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			p.finishOrphan(ctx, m)
		}()
	}
	ents, _ := os.ReadDir(c.cfg.StateDir)
	for _, e := range ents {
		if !known[e.Name()] {
			os.RemoveAll(filepath.Join(c.cfg.StateDir, e.Name()))
		}
	}
	for _, p := range c.pools {
		p.updateGauges()
	}
}

// destroyContainer removes a container and its task, whatever state they are in.
func (c *Controller) destroyContainer(ctx context.Context, ctr containerd.Container) {
	ctx = context.WithoutCancel(ctx)
	labels, _ := ctr.Labels(ctx)
	moved := labels[LabelCgroup]
	if task, err := ctr.Task(ctx, nil); err == nil {
		killAndDelete(ctx, task, func() {
			if spec, err := ctr.Spec(ctx); err == nil && spec.Linux != nil && spec.Linux.CgroupsPath != "" {
				c.cgroups.Thaw(spec.Linux.CgroupsPath) // an idle member frozen by freezeMember
			}
			if moved != "" {
				c.cgroups.Signal(moved, syscall.SIGKILL)
				c.cgroups.Thaw(moved)
			}
		})
	}
	if moved != "" {
		if err := c.cgroups.Delete(moved); err != nil {
			log.G(ctx).WithError(err).WithField("member", ctr.ID()).WithField("cgroup", moved).Warn("pools: cannot remove the container cgroup of a member")
		}
	}
	if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		log.G(ctx).WithError(err).WithField("member", ctr.ID()).Warn("pools: cannot delete member container")
	}
	os.RemoveAll(filepath.Join(c.cfg.StateDir, ctr.ID()))
}

var errNoMember = errors.New("no idle member")

// Close stops the controller (containerd closes plugin instances this way).
func (c *Controller) Close() error {
	c.Stop()
	return nil
}

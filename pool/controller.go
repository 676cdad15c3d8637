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
	"github.com/tidepool-dev/tidepool/pool/holder"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// Container labels that make a member findable with ctr and after a restart.
const (
	LabelPool    = "dev.tidepool.pool"
	LabelMember  = "dev.tidepool.member"
	LabelState   = "dev.tidepool.member-state"
	LabelCreated = "dev.tidepool.member-created"
)

// MemberIDPrefix starts every member's container id ("tidepool-node-3f9a0c12be47"),
// so that `ctr c ls` in a namespace a pool serves tells members from other containers.
const MemberIDPrefix = "tidepool-"

// Member states, as recorded in LabelState.
const (
	stateIdle    = "idle"
	stateClaimed = "claimed"
)

// Config configures the controller.
type Config struct {
	// ContainerdAddress locates the containerd the members live in.
	ContainerdAddress string
	// Namespaces are the containerd namespaces of templates that name none
	// (DefaultNamespaces if empty).
	Namespaces []string
	// StateDir holds one control directory per member.
	StateDir string
	// Holder is the tidepool-holder binary, bind-mounted read-only into members.
	Holder string
	// ShimConfig, if set, is passed to the tidepool shim as its config path.
	ShimConfig string
	// Snapshotter is the name containerd knows the tidepool snapshotter by.
	Snapshotter string
	// KernelViews: the snapshotter serves kernel views (views.mode kernel, or auto
	// on a kernel that supports them). Members on the runc route then get a slot
	// (binding.LabelSlot) instead of a late-bound FUSE view in their rootfs, and a
	// claim mounts the fork's kernel view onto it: see the package doc.
	KernelViews bool
	Templates   []Template
}

// Snapshots is what the pools need from the tidepool snapshotter (which
// *snapshotter.Snapshotter is): the member snapshots' keys and state, and binding,
// re-keying and committing them.
type Snapshots interface {
	KeyFromMounts(ctx context.Context, mounts []mount.Mount) (string, error)
	Stat(ctx context.Context, key string) (snapshots.Info, error)
	CheckLateBind(ctx context.Context, key string) error
	SlotDir(ctx context.Context, key string) (string, error)
	OpenSlot(ctx context.Context, key string) error
	PrebuildSlotView(ctx context.Context, root casstore.Hash, owner string) error
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

	// pools holds each template's member sets, one per namespace it serves, in
	// the order configured.
	pools map[string][]*Pool
	// claims is when claims last took members: background work yields to them.
	claims claimActivity

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
	if cfg.Snapshotter == "" {
		cfg.Snapshotter = "tidepool"
	}
	c := &Controller{cfg: cfg, sn: sn, cgroups: v1Cgroups{}, metrics: newMetrics(), pools: map[string][]*Pool{}, ready: make(chan struct{}),
		newMember: (*Pool).create}
	for i := range cfg.Templates {
		t := cfg.Templates[i]
		if len(t.Namespaces) == 0 {
			t.Namespaces = cfg.Namespaces
		}
		if err := t.Validate(); err != nil {
			return nil, err
		}
		if _, dup := c.pools[t.Name]; dup {
			return nil, fmt.Errorf("pool %q is configured twice", t.Name)
		}
		// The holder listens on STATEDIR/<member id>/ctl.sock, and a unix socket's
		// path has room for 107 bytes.
		if sock := filepath.Join(cfg.StateDir, newMemberID(t.Name), holder.ControlName); len(sock) > maxSocketPath {
			return nil, fmt.Errorf("pool %q: member control sockets would be %d bytes long (%s), over the %d a unix socket allows: shorten the pool's name or tidepoold's root", t.Name, len(sock), sock, maxSocketPath)
		}
		for _, ns := range t.Namespaces {
			c.pools[t.Name] = append(c.pools[t.Name], newPool(c, t, ns))
		}
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
		if ents, _ := os.ReadDir(c.cfg.StateDir); len(ents) == 0 {
			return
		}
		// Every pool was removed from the configuration, but members of an earlier
		// tidepoold are left (their control directories say so): drain them.
		ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			if err := c.connect(ctx); err == nil {
				c.reconcile(ctx)
			}
		}()
		return
	}
	ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		if err := c.connect(ctx); err != nil {
			return
		}
		c.reconcile(ctx)
		close(c.ready)
		for _, sets := range c.pools {
			for _, p := range sets {
				c.wg.Add(1)
				go func(p *Pool) {
					defer c.wg.Done()
					p.maintain(p.nsContext(ctx))
				}(p)
			}
		}
	}()
}

func (c *Controller) connect(ctx context.Context) error {
	for {
		// Every call names its namespace (Pool.nsContext); none relies on a default.
		cl, err := containerd.New(c.cfg.ContainerdAddress)
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

// teardownGrace bounds how long Stop waits for used members being destroyed. Their
// calls to containerd outlive the requests that used them and wait for containerd
// if it is gone (as when the host stops it first); Stop then closes the connection,
// which ends them, and the next start destroys what is left of those members.
const teardownGrace = 3 * time.Second

// Stop stops refilling. Idle members stay, frozen, for the next start to adopt.
func (c *Controller) Stop() {
	if c.cancel != nil {
		c.cancel()
	}
	c.wg.Wait()
	torn := make(chan struct{})
	go func() {
		c.teardowns.Wait()
		close(torn)
	}()
	select {
	case <-torn:
	case <-time.After(teardownGrace):
		log.L.Warn("pools: used members still being destroyed at shutdown; closing the containerd connection, the next start destroys them")
		c.mu.Lock()
		if c.client != nil {
			c.client.Close()
			c.client = nil
		}
		c.mu.Unlock()
		<-torn
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.client != nil {
		c.client.Close()
	}
}

// Status is one pool's state, summed over the namespaces it serves (each has
// min, target and max members of its own).
type Status struct {
	Name                    string
	Image                   string
	Namespaces              []string
	Idle, Claimed, Starting int
	Min, Target, Max        int
}

// List reports every pool.
func (c *Controller) List() []Status {
	var out []Status
	for name, sets := range c.pools {
		t := sets[0].t
		st := Status{Name: name, Image: t.Image, Namespaces: t.Namespaces}
		for _, p := range sets {
			p.mu.Lock()
			st.Idle, st.Claimed, st.Starting = st.Idle+len(p.idle), st.Claimed+p.claimed+p.lent, st.Starting+p.starting
			p.mu.Unlock()
			st.Min, st.Target, st.Max = st.Min+t.Min, st.Target+t.Target, st.Max+t.Max
		}
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// pool picks the member set an explicit claim (Run) takes from: the one with the
// most idle members, the first configured on a tie. Explicit claims run in a
// member whatever its namespace; only transparent ones must match (inNamespace).
func (c *Controller) pool(name string) (*Pool, error) {
	sets, err := c.sets(name)
	if err != nil {
		return nil, err
	}
	best, most := sets[0], -1
	for _, p := range sets {
		p.mu.Lock()
		n := len(p.idle)
		p.mu.Unlock()
		if n > most {
			best, most = p, n
		}
	}
	return best, nil
}

// inNamespace is the member set of a pool in one namespace, nil if the pool does
// not serve it.
func inNamespace(sets []*Pool, ns string) *Pool {
	for _, p := range sets {
		if p.ns == ns {
			return p
		}
	}
	return nil
}

// sets are a pool's member sets, one per namespace it serves.
func (c *Controller) sets(name string) ([]*Pool, error) {
	sets, ok := c.pools[name]
	if !ok {
		names := make([]string, 0, len(c.pools))
		for n := range c.pools {
			names = append(names, n)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("no pool %q (configured: %s): %w", name, strings.Join(names, ", "), errdefs.ErrNotFound)
	}
	return sets, nil
}

func (c *Controller) waitReady(ctx context.Context) error {
	select {
	case <-c.ready:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pools are not ready (is containerd reachable at %s?): %w", c.cfg.ContainerdAddress, ctx.Err())
	}
}

func (c *Controller) containerd() *containerd.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.client
}

// reconcile deals with the members a previous tidepoold left: claimed ones are
// finished (their workload's changes are committed when it exits), everything else is
// destroyed and the pools refill, so nothing leaks. It looks in every namespace, so
// the members of a namespace a pool no longer serves go too; a container counts as a
// member only if its member label names it (a user's container labelled
// dev.tidepool.pool is left alone).
func (c *Controller) reconcile(ctx context.Context) {
	cl := c.containerd()
	nss, err := cl.NamespaceService().List(ctx)
	if err != nil {
		log.G(ctx).WithError(err).Warn("pools: cannot list namespaces to reconcile")
		return
	}
	known := map[string]bool{}
	// Destroying a member takes a few container operations; a daemon that left many
	// (a pool of 50 removed from the configuration) is drained a few at a time.
	d := &destroyer{c: c, slots: make(chan struct{}, reconcileParallel)}
	for _, ns := range nss {
		c.reconcileNamespace(namespaces.WithNamespace(ctx, ns), ns, known, d)
	}
	d.wg.Wait()
	ents, _ := os.ReadDir(c.cfg.StateDir)
	for _, e := range ents {
		if !known[e.Name()] {
			os.RemoveAll(filepath.Join(c.cfg.StateDir, e.Name()))
		}
	}
	for _, sets := range c.pools {
		for _, p := range sets {
			p.updateGauges()
		}
	}
}

// maxSocketPath is the longest path a unix socket address holds (sun_path, less
// its terminating NUL).
const maxSocketPath = 107

// reconcileParallel is how many leftover members reconcile destroys at once.
const reconcileParallel = 4

// destroyer destroys containers in the background, a few at a time.
type destroyer struct {
	c     *Controller
	slots chan struct{}
	wg    sync.WaitGroup
}

func (d *destroyer) destroy(ctx context.Context, ctr containerd.Container) {
	d.wg.Add(1)
	d.slots <- struct{}{}
	go func() {
		defer func() {
			<-d.slots
			d.wg.Done()
		}()
		d.c.destroyContainer(ctx, ctr)
	}()
}

// reconcileCreates finishes the member creations a killed tidepoold left half
// done: each creation's lease (see Pool.create) still names its member; a member
// whose container was never made leaves a prepared snapshot that nothing else
// would remove for a day, so it is removed here, and every such lease goes.
func (c *Controller) reconcileCreates(ctx context.Context, ns string) {
	cl := c.containerd()
	ls, err := cl.LeasesService().List(ctx, fmt.Sprintf("labels.%q", LabelMember))
	if err != nil {
		log.G(ctx).WithError(err).WithField("namespace", ns).Warn("pools: cannot list member creation leases")
		return
	}
	for _, l := range ls {
		id := l.Labels[LabelMember]
		logger := log.G(ctx).WithField("member", id).WithField("namespace", ns)
		if !strings.HasPrefix(id, MemberIDPrefix) || l.ID != id {
			continue // not a lease Pool.create made
		}
		if _, err := cl.LoadContainer(ctx, id); errdefs.IsNotFound(err) {
			if err := cl.SnapshotService(c.cfg.Snapshotter).Remove(ctx, id); err != nil && !errdefs.IsNotFound(err) {
				logger.WithError(err).Warn("pools: cannot remove the snapshot of a member whose creation was cut short")
				continue // its lease stays: the next start tries again
			}
			logger.Info("pools: removed the snapshot of a member whose creation was cut short")
		}
		if err := cl.LeasesService().Delete(ctx, l); err != nil && !errdefs.IsNotFound(err) {
			logger.WithError(err).Warn("pools: cannot delete a member creation lease")
		}
	}
}

func (c *Controller) reconcileNamespace(ctx context.Context, ns string, known map[string]bool, d *destroyer) {
	c.reconcileCreates(ctx, ns)
	list, err := c.containerd().Containers(ctx, fmt.Sprintf("labels.%q", LabelMember))
	if err != nil {
		log.G(ctx).WithError(err).WithField("namespace", ns).Warn("pools: cannot list members to reconcile")
		return
	}
	for _, ctr := range list {
		labels, err := ctr.Labels(ctx)
		if err != nil || labels[LabelMember] != ctr.ID() {
			continue
		}
		known[ctr.ID()] = true
		logger := log.G(ctx).WithField("member", ctr.ID()).WithField("namespace", ns)
		p := inNamespace(c.pools[labels[LabelPool]], ns)
		if p == nil {
			logger.Info("pools: destroying a member of a pool that no longer serves its namespace")
			d.destroy(ctx, ctr)
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
			d.destroy(ctx, ctr)
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
}

// destroyContainer removes a container and its task, whatever state they are in.
func (c *Controller) destroyContainer(ctx context.Context, ctr containerd.Container) {
	ctx = context.WithoutCancel(ctx)
	labels, _ := ctr.Labels(ctx)
	moved := labels[LabelCgroup]
	var own string // the member's own cgroup, runc's cgroupsPath
	if spec, err := ctr.Spec(ctx); err == nil && spec.Linux != nil {
		own = spec.Linux.CgroupsPath
	}
	task, err := ctr.Task(ctx, nil)
	switch {
	case err == nil:
		killAndDelete(ctx, task, func() {
			if own != "" {
				c.cgroups.Thaw(own) // an idle member frozen by freezeMember
			}
			if moved != "" {
				c.cgroups.Signal(moved, syscall.SIGKILL)
				c.cgroups.Thaw(moved)
			}
		})
	case errdefs.IsNotFound(err) && own != "":
		// A member whose creation a killed tidepoold cut short has no task, but
		// runc may have made its cgroup (and started its init) before it was
		// stopped: nothing else would remove them.
		if err := removeCgroup(c.cgroups, own, true); err != nil {
			log.G(ctx).WithError(err).WithField("member", ctr.ID()).WithField("cgroup", own).Warn("pools: cannot remove the cgroup of a member that never started")
		}
	}
	if moved != "" {
		if err := removeCgroup(c.cgroups, moved, true); err != nil {
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

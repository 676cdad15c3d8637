package pool

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/moby/sys/mountinfo"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/pool/holder"
)

// Member is one pre-created container of a pool.
type Member struct {
	id        string
	pool      *Pool
	created   time.Time
	dir       string // control directory on the host
	cgroup    string // where the member's processes live (runc's cgroupsPath)
	holderUID uint32 // the image's user, which the holder runs as
	holderGID uint32
	movedTo   string // the adopting container's cgroup, once the member's processes moved there
	// runcPaused: the task is paused through containerd (runc), not only its freezer
	// cgroup frozen by us (freezeMember), so containerd must resume it.
	runcPaused bool
	snapKey    string // the tidepool snapshotter's key of its rootfs
	// slot is the host directory the member binds at its workdir when the fork is
	// mounted there at claim (binding.LabelSlot); "" for a late-bound FUSE view in
	// its rootfs.
	slot      string
	boundRoot casstore.Hash // the root a claim bound (slot members)
	env       []string
	container containerd.Container
	task      containerd.Task
	exited    <-chan containerd.ExitStatus // waited on from creation, off the claim path
	// ended: its task's exit came through exited, so its teardown is a delete alone.
	ended atomic.Bool
}

// exitStatus receives the member's exit status and records that its task ended.
func (m *Member) exitStatus() containerd.ExitStatus {
	st := <-m.exited
	m.ended.Store(true)
	return st
}

// Pool is one template's members in one containerd namespace.
type Pool struct {
	t  Template
	ns string // the containerd namespace the members live in
	c  *Controller

	mu   sync.Mutex
	idle []*Member // oldest first
	// lent: idle members out for an adoption's eligibility check. They count as
	// present, so that a refill does not replace a member that may come back.
	lent     int
	claimed  int
	starting int
	waiting  int           // claims waiting for a member of this set
	changed  chan struct{} // signalled when members come or go
	lastFill time.Time
	retryAt  time.Time     // no new member before this, after a failure
	backoff  time.Duration // doubles on consecutive failures
}

func newPool(c *Controller, t Template, ns string) *Pool {
	return &Pool{t: t, ns: ns, c: c, changed: make(chan struct{}, 1)}
}

// nsContext puts the members' containerd namespace on a context.
func (p *Pool) nsContext(ctx context.Context) context.Context {
	return namespaces.WithNamespace(ctx, p.ns)
}

func (p *Pool) poke() {
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

func (p *Pool) updateGauges() {
	p.mu.Lock()
	idle, claimed, starting := len(p.idle), p.claimed+p.lent, p.starting
	var oldest float64
	if idle > 0 {
		oldest = time.Since(p.idle[0].created).Seconds()
	}
	p.mu.Unlock()
	m := p.c.metrics
	m.members.WithLabelValues(p.t.Name, p.ns, "idle").Set(float64(idle))
	m.members.WithLabelValues(p.t.Name, p.ns, "claimed").Set(float64(claimed))
	m.members.WithLabelValues(p.t.Name, p.ns, "starting").Set(float64(starting))
	m.oldestIdle.WithLabelValues(p.t.Name, p.ns).Set(oldest)
}

// maintain keeps the pool at target: it starts members (at most RefillRate a second,
// a few at a time) and recycles members older than MaxAge.
func (p *Pool) maintain(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var fills sync.WaitGroup
	defer fills.Wait() // members being started: Stop stops them too
	for {
		p.recycle(ctx)
		for p.needMember() {
			wait := time.Until(p.lastFill.Add(time.Duration(float64(time.Second) / p.t.RefillRate)))
			if wait > 0 {
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
			}
			// Claims first: a member started now would compete with them.
			p.c.claims.yield(ctx, p.urgent)
			if ctx.Err() != nil {
				return
			}
			p.mu.Lock()
			p.starting++
			p.lastFill = time.Now()
			p.mu.Unlock()
			fills.Add(1)
			go func() {
				defer fills.Done()
				p.fill(ctx)
			}()
		}
		p.updateGauges()
		select {
		case <-ctx.Done():
			return
		case <-p.changed:
		case <-tick.C:
		}
	}
}

// have is how many members the pool has or will have for claims (p.mu held): idle,
// starting, and lent to an eligibility check, which may give them back (replacing one
// would leave a member too many).
func (p *Pool) have() int {
	return len(p.idle) + p.starting + p.lent
}

// urgent reports whether a new member must start whatever claims are doing: a claim
// waits for one, or the pool is below its minimum.
func (p *Pool) urgent() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waiting > 0 || p.have() < p.t.Min
}

// needMember reports whether one more member should start now: below target, with at
// most two starting at once, and never above max.
func (p *Pool) needMember() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	have := p.have()
	return have < p.t.Target && p.starting < 2 && have+p.claimed < p.t.Max && !time.Now().Before(p.retryAt)
}

func (p *Pool) fill(ctx context.Context) {
	m, err := p.c.newMember(p, ctx)
	p.mu.Lock()
	p.starting--
	if err == nil {
		p.idle = append(p.idle, m)
		p.backoff = 0
	} else {
		// Do not spin on a persistent failure (an image not pulled yet, say).
		p.backoff = min(max(2*p.backoff, 500*time.Millisecond), 30*time.Second)
		p.retryAt = time.Now().Add(p.backoff)
	}
	p.mu.Unlock()
	if err != nil && ctx.Err() == nil {
		log.G(ctx).WithError(err).WithField("pool", p.t.Name).WithField("namespace", p.ns).Warn("pools: could not start a member")
	}
	p.updateGauges()
	p.poke()
}

func (p *Pool) recycle(ctx context.Context) {
	p.mu.Lock()
	var old []*Member
	keep := p.idle[:0]
	for _, m := range p.idle {
		if time.Since(m.created) > p.t.MaxAge {
			old = append(old, m)
		} else {
			keep = append(keep, m)
		}
	}
	p.idle = keep
	p.mu.Unlock()
	for _, m := range old {
		p.discard(ctx, m, "max_age")
	}
}

// take removes the oldest idle member, waiting (and asking for a refill) while the
// pool is empty.
func (p *Pool) take(ctx context.Context) (*Member, error) {
	waiting := false
	defer func() {
		if waiting {
			p.mu.Lock()
			p.waiting--
			p.mu.Unlock()
		}
	}()
	for {
		p.mu.Lock()
		if len(p.idle) > 0 {
			m := p.idle[0]
			p.idle = p.idle[1:]
			p.claimed++
			p.mu.Unlock()
			p.c.claims.took()
			p.poke()
			return m, nil
		}
		if !waiting {
			waiting = true
			p.waiting++
		}
		p.mu.Unlock()
		p.poke()
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("pool %q: %w while waiting for a member: %w", p.t.Name, errNoMember, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// release forgets a claimed member once it is finished.
func (p *Pool) release() {
	p.mu.Lock()
	p.claimed--
	p.mu.Unlock()
	p.updateGauges()
	p.poke()
}

// newMemberID names a member so that it reads as one in `ctr c ls`, where members
// in a namespace people use (default) sit beside their own containers.
func newMemberID(pool string) string {
	var b [6]byte
	rand.Read(b[:])
	return MemberIDPrefix + pool + "-" + hex.EncodeToString(b[:])
}

// create starts one member: container, late-bound snapshot, task through the tidepool
// shim with the holder as pid 1; frozen once the holder listens.
func (p *Pool) create(ctx context.Context) (_ *Member, retErr error) {
	ctx = p.nsContext(ctx)
	c := p.c
	cl := c.containerd()
	id := newMemberID(p.t.Name)
	m := &Member{id: id, pool: p, created: time.Now(), dir: filepath.Join(c.cfg.StateDir, id)}
	defer func() {
		if retErr != nil {
			p.destroy(context.WithoutCancel(ctx), m)
		}
	}()
	// Only root and, once the image's user is known, the holder may enter the
	// control directory: whoever can bind its socket receives the workload.
	if err := os.Mkdir(m.dir, 0o700); err != nil {
		return nil, err
	}
	image, err := cl.GetImage(ctx, p.t.Image)
	if err != nil {
		// Each namespace a pool serves needs the image: a container adopts only a
		// member unpacked from its own namespace's copy.
		return nil, fmt.Errorf("pool image %s in namespace %s (pull or import it there, e.g. ctr -n %s images pull): %w", p.t.Image, p.ns, p.ns, err)
	}
	if ok, err := image.IsUnpacked(ctx, c.cfg.Snapshotter); err != nil || !ok {
		if err := image.Unpack(ctx, c.cfg.Snapshotter); err != nil {
			return nil, fmt.Errorf("unpack %s for %s: %w", p.t.Image, c.cfg.Snapshotter, err)
		}
	}
	specOpts := []oci.SpecOpts{
		oci.WithImageConfig(image),
		// The holder must not look the workdir up before the fork is bound, so it
		// starts in /; the workload's cwd comes with the claim.
		oci.WithProcessArgs(holder.HolderPath, holder.ControlDir),
		oci.WithProcessCwd("/"),
		oci.WithMounts([]specs.Mount{
			{Destination: holder.HolderPath, Type: "bind", Source: c.cfg.Holder, Options: []string{"rbind", "ro"}},
			{Destination: holder.ControlDir, Type: "bind", Source: m.dir, Options: []string{"rbind", "rw"}},
		}),
		oci.WithAnnotations(p.t.annotations(id)),
	}
	if p.t.Memory > 0 {
		specOpts = append(specOpts, oci.WithMemoryLimit(uint64(p.t.Memory)))
	}
	if p.t.CPUs > 0 {
		const period = 100000
		specOpts = append(specOpts, oci.WithCPUCFS(int64(p.t.CPUs*period), period))
	}
	snapLabels := map[string]string{
		binding.LabelLateBind: "true", binding.LabelWorkdir: p.t.Workdir, binding.LabelOwner: p.t.Owner,
	}
	if p.slots() {
		snapLabels[binding.LabelSlot] = "true"
		specOpts = append(specOpts, p.withSlot(m))
	}
	var rtOpts any
	if c.cfg.ShimConfig != "" {
		rtOpts = &runtimeoptions.Options{ConfigPath: c.cfg.ShimConfig}
	}
	// The snapshot is prepared, then the container made, under a lease of our own
	// that names the member: a tidepoold killed between the two leaves a snapshot
	// no container holds (the client's own lease would keep it for a day), which
	// the next start finds by this lease and removes (reconcileCreates).
	lctx, leaseDone, err := cl.WithLease(ctx, leases.WithID(id), leases.WithExpiration(24*time.Hour),
		leases.WithLabels(map[string]string{LabelMember: id}))
	if err != nil {
		return nil, fmt.Errorf("lease for member %s: %w", id, err)
	}
	ctr, err := cl.NewContainer(lctx, id,
		containerd.WithImage(image),
		containerd.WithSnapshotter(c.cfg.Snapshotter),
		containerd.WithNewSnapshot(id, image, snapshots.WithLabels(snapLabels)),
		containerd.WithRuntime(binding.RuntimeName, rtOpts),
		containerd.WithNewSpec(specOpts...),
		containerd.WithContainerLabels(map[string]string{
			LabelPool: p.t.Name, LabelMember: id, LabelState: stateIdle,
			LabelCreated: strconv.FormatInt(m.created.Unix(), 10),
		}),
	)
	// Once made, the container holds its snapshot; if it was not made, dropping the
	// lease lets containerd's GC collect the snapshot.
	if derr := leaseDone(context.WithoutCancel(ctx)); derr != nil {
		log.G(ctx).WithError(derr).WithField("member", id).Warn("pools: cannot delete a member's creation lease; the next start does")
	}
	if err != nil {
		return nil, fmt.Errorf("create member container: %w", err)
	}
	m.container = ctr
	if err := m.describe(ctx); err != nil {
		return nil, err
	}
	if err := os.Chown(m.dir, int(m.holderUID), int(m.holderGID)); err != nil {
		return nil, fmt.Errorf("member control directory: %w", err)
	}
	task, err := ctr.NewTask(ctx, cio.NullIO)
	if err != nil {
		return nil, fmt.Errorf("create member task: %w", err)
	}
	m.task = task
	if m.exited, err = task.Wait(ctx); err != nil {
		return nil, fmt.Errorf("wait for member task: %w", err)
	}
	if err := task.Start(ctx); err != nil {
		return nil, fmt.Errorf("start member task: %w", err)
	}
	if err := holder.WaitReady(m.dir, 30*time.Second); err != nil {
		return nil, err
	}
	if m.slot != "" {
		if err := checkSlot(int(task.Pid()), p.t.Workdir); err != nil {
			return nil, err
		}
	}
	if err := freezeMember(ctx, m); err != nil {
		return nil, fmt.Errorf("freeze member: %w", err)
	}
	return m, nil
}

// slots says whether the pool's members get a slot for a kernel view at claim:
// kernel views are in use, and the member is a runc container, into whose mount
// namespace the host's mounts propagate (runsc's gofer and a VM would not see them).
func (p *Pool) slots() bool { return p.c.cfg.KernelViews && p.t.Runtime == "runc" }

// withSlot binds the member's slot at the pool's workdir, rslave: a view the claim
// mounts onto the slot on the host appears there, in the running, frozen member.
// The slot belongs to the member's snapshot, prepared before the spec is made.
func (p *Pool) withSlot(m *Member) oci.SpecOpts {
	return func(ctx context.Context, _ oci.Client, ctr *containers.Container, s *oci.Spec) error {
		c := p.c
		mounts, err := c.containerd().SnapshotService(c.cfg.Snapshotter).Mounts(ctx, ctr.SnapshotKey)
		if err != nil {
			return fmt.Errorf("member rootfs mounts: %w", err)
		}
		key, err := c.sn.KeyFromMounts(ctx, mounts)
		if err != nil {
			return err
		}
		if m.slot, err = c.sn.SlotDir(ctx, key); err != nil {
			return err
		}
		s.Mounts = append(s.Mounts, specs.Mount{Destination: p.t.Workdir, Type: "bind", Source: m.slot, Options: []string{"rbind", "rw", "rslave"}})
		return nil
	}
}

// checkSlot makes sure that mounts onto the slot reach the member: its workdir is a
// slave mount (a runtime that made it private would leave the claim's view out).
func checkSlot(pid int, workdir string) error {
	ms, err := mountinfo.PidMountInfo(pid)
	if err != nil {
		return fmt.Errorf("member mounts: %w", err)
	}
	for i := len(ms) - 1; i >= 0; i-- {
		if ms[i].Mountpoint != workdir {
			continue
		}
		if !strings.Contains(ms[i].Optional, "master:") {
			return fmt.Errorf("the member's workdir %s does not receive the host's mounts (propagation %q, want a slave): its runtime does not keep the slot's rslave propagation", workdir, ms[i].Optional)
		}
		return nil
	}
	return fmt.Errorf("the member has no mount at its workdir %s", workdir)
}

// withoutSlot is spec without the member's slot mount, for comparing it with a
// container's own spec: the slot stands for the workdir the container gets.
func withoutSlot(spec *specs.Spec, slot string) *specs.Spec {
	if slot == "" {
		return spec
	}
	out := *spec
	out.Mounts = nil
	for _, mt := range spec.Mounts {
		if mt.Source != slot {
			out.Mounts = append(out.Mounts, mt)
		}
	}
	return &out
}

// describe fills what a claim needs from the member's container: its snapshot key in
// the tidepool snapshotter and its environment.
func (m *Member) describe(ctx context.Context) error {
	c := m.pool.c
	info, err := m.container.Info(ctx)
	if err != nil {
		return err
	}
	mounts, err := c.containerd().SnapshotService(c.cfg.Snapshotter).Mounts(ctx, info.SnapshotKey)
	if err != nil {
		return fmt.Errorf("member rootfs mounts: %w", err)
	}
	if m.snapKey, err = c.sn.KeyFromMounts(ctx, mounts); err != nil {
		return err
	}
	spec, err := m.container.Spec(ctx)
	if err != nil {
		return err
	}
	if spec.Process != nil {
		m.env = spec.Process.Env
		m.holderUID, m.holderGID = spec.Process.User.UID, spec.Process.User.GID
	}
	if spec.Linux != nil {
		m.cgroup = spec.Linux.CgroupsPath
	}
	return nil
}

// holderPeer is who must be listening on the member's control socket.
func (m *Member) holderPeer() holder.Peer {
	cg := m.cgroup
	if m.movedTo != "" {
		cg = m.movedTo
	}
	return holder.Peer{Pid: int32(m.task.Pid()), Cgroup: cg}
}

// adopt takes over a claimed member a previous tidepoold left, so that its workload's
// changes are still committed when it exits. Idle members are not adopted: fork views
// are served by tidepoold itself, so an idle member's view died with the daemon that
// made it, and the overlay above still holds that dead mount; the member could never
// take a fork. (Adopting idle members needs views that outlive the daemon: design.md
// section 3, the next milestone.)
func (p *Pool) adopt(ctx context.Context, ctr containerd.Container, labels map[string]string) (*Member, error) {
	if labels[LabelState] != stateClaimed {
		return nil, fmt.Errorf("its fork view was served by the previous tidepoold")
	}
	m, err := p.reattach(ctx, ctr, labels)
	if err != nil {
		return nil, err
	}
	if err := m.describe(ctx); err != nil {
		return nil, err
	}
	return m, nil
}

// reattach rebuilds a member's record from its container and task.
func (p *Pool) reattach(ctx context.Context, ctr containerd.Container, labels map[string]string) (*Member, error) {
	created, _ := strconv.ParseInt(labels[LabelCreated], 10, 64)
	m := &Member{id: ctr.ID(), pool: p, created: time.Unix(created, 0), dir: filepath.Join(p.c.cfg.StateDir, ctr.ID()), container: ctr,
		movedTo: labels[LabelCgroup]}
	task, err := ctr.Task(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("no task: %w", err)
	}
	m.task = task
	if m.exited, err = task.Wait(ctx); err != nil {
		return nil, fmt.Errorf("wait for member task: %w", err)
	}
	return m, nil
}

// discard destroys a member that never ran a workload and counts why.
func (p *Pool) discard(ctx context.Context, m *Member, reason string) {
	p.c.metrics.discarded.WithLabelValues(p.t.Name, reason).Inc()
	p.destroy(ctx, m)
}

// pause and resume freeze and thaw a member: through runc, and the container's own
// cgroup too once its processes moved there.
func (m *Member) pause(ctx context.Context) error {
	if m.movedTo != "" {
		if err := m.pool.c.cgroups.Freeze(m.movedTo); err != nil {
			return err
		}
	}
	if err := m.task.Pause(ctx); err != nil {
		return err
	}
	m.runcPaused = true
	return nil
}

func (m *Member) resume(ctx context.Context) error {
	if err := thawMember(ctx, m); err != nil {
		return err
	}
	if m.movedTo != "" {
		return m.pool.c.cgroups.Thaw(m.movedTo)
	}
	return nil
}

// destroy removes a member: task, container, snapshot (its changes, if any, were
// committed or are deliberately thrown away), the container cgroup it was moved to,
// and control directory.
func (p *Pool) destroy(ctx context.Context, m *Member) {
	ctx = p.nsContext(context.WithoutCancel(ctx))
	// Teardown is background work: let the claims under way finish first.
	p.c.claims.yield(ctx, nil)
	switch {
	case m.task != nil && m.ended.Load():
		// The exit is known, so nothing is left to kill, and a kill would cost a runc
		// run under the task's lock in the shim for nothing (see the shim's reap.go).
		if _, err := m.task.Delete(ctx); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("task", m.task.ID()).Warn("pools: cannot delete member task")
		}
	case m.task != nil:
		killAndDelete(ctx, m.task, func() {
			if m.cgroup != "" && !m.runcPaused {
				p.c.cgroups.Thaw(m.cgroup) // frozen by freezeMember: containerd's resume cannot thaw it
			}
			if m.movedTo != "" {
				// A frozen cgroup holds the signal until it thaws.
				p.c.cgroups.Signal(m.movedTo, syscall.SIGKILL)
				p.c.cgroups.Thaw(m.movedTo)
			}
		})
	}
	if m.movedTo != "" {
		if err := removeCgroup(p.c.cgroups, m.movedTo, false); err != nil {
			log.G(ctx).WithError(err).WithField("member", m.id).WithField("cgroup", m.movedTo).Warn("pools: cannot remove the container cgroup of a member")
		}
	}
	if m.task == nil && m.cgroup != "" {
		// A member whose task create failed or was cut short: runc may have made
		// its cgroup (and started its init) before it stopped, and with no task no
		// runc delete removes them.
		if err := removeCgroup(p.c.cgroups, m.cgroup, true); err != nil {
			log.G(ctx).WithError(err).WithField("member", m.id).WithField("cgroup", m.cgroup).Warn("pools: cannot remove the cgroup of a member that never started")
		}
	}
	if m.container != nil {
		if err := m.container.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("member", m.id).Warn("pools: cannot delete member container")
		}
	}
	os.RemoveAll(m.dir)
}

// killAndDelete ends a task in any state. A frozen task is thawed after the kill so
// the signal is delivered.
func killAndDelete(ctx context.Context, task containerd.Task, afterKill func()) {
	wait, werr := task.Wait(ctx)
	if err := task.Kill(ctx, syscall.SIGKILL, containerd.WithKillAll); err == nil {
		task.Resume(ctx)
		if afterKill != nil {
			afterKill()
		}
		if werr == nil {
			select {
			case <-wait:
			case <-time.After(10 * time.Second):
			}
		}
	}
	if _, err := task.Delete(ctx, containerd.WithProcessKill); err != nil && !errdefs.IsNotFound(err) {
		log.G(ctx).WithError(err).WithField("task", task.ID()).Warn("pools: cannot delete member task")
	}
}

// finishOrphan waits for the workload of a member whose client went away (a daemon
// restart), commits its changes to the fork and destroys it.
func (p *Pool) finishOrphan(ctx context.Context, m *Member) {
	defer p.release()
	select {
	case <-m.exited:
		m.ended.Store(true)
	case <-ctx.Done():
		return // the next start adopts it again
	}
	if _, _, err := p.c.sn.CommitNow(ctx, m.snapKey); err != nil {
		log.G(ctx).WithError(err).WithField("member", m.id).Warn("pools: cannot commit an orphaned member; its snapshot commits when removed")
	}
	p.destroy(ctx, m)
}

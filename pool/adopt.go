package pool

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/pool/holder"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// LabelAdoptedBy names the container that adopted a member; LabelCgroup the
// container's cgroup its processes were moved into.
const (
	LabelAdoptedBy = "dev.tidepool.adopted-by"
	LabelCgroup    = "dev.tidepool.member-cgroup"
)

// moveToContainerCgroup makes the cgroup the container asked for (its path and
// resources) and moves the member's processes into it, frozen. On failure it returns
// the cold-fallback reason.
func (c *Controller) moveToContainerCgroup(ctx context.Context, m *Member, l *specs.Linux) (string, error) {
	procs, err := m.task.Pids(ctx)
	if err != nil {
		return "cgroup_apply_failed", err
	}
	pids := make([]int, 0, len(procs))
	for _, p := range procs {
		pids = append(pids, int(p.Pid))
	}
	err = c.cgroups.Move(l.CgroupsPath, l.Resources, pids)
	if errors.Is(err, errCgroupInUse) {
		return "cgroups_path_in_use", err
	}
	m.movedTo = l.CgroupsPath // ours now, even half made: destroy removes it
	if err != nil {
		return "cgroup_apply_failed", err
	}
	return "", nil
}

// AdoptRequest is a container created with the dev.tidepool.pool annotation, as its
// runtime shim sees it at create.
type AdoptRequest struct {
	Pool        string
	ContainerID string
	Rootfs      []mount.Mount
	Spec        *specs.Spec
	Fork        string
	Workdir     string
	Owner       string
	Discard     bool
	// Runtime is the shim route the container resolved to.
	Runtime string
}

// Adoption is the member a container adopted, or why it must start cold.
type Adoption struct {
	ColdReason    string
	Member        string
	Pid           uint32
	ControlSocket string
	ForkID        string
	Root          casstore.Hash
}

// adopted is the bookkeeping of a member driven by a container's shim.
type adopted struct {
	m         *Member
	container string
	once      sync.Once
	done      chan struct{}
	status    containerd.ExitStatus
}

func (a *adopted) watch() {
	a.once.Do(func() {
		go func() {
			a.status = a.m.exitStatus()
			close(a.done)
		}()
	})
}

// Adopt gives an eligible container an idle member of its pool: the member's
// snapshot is re-keyed to the container's (so the container's snapshot is what the
// task runs on), the fork is bound to it, and the shim then hands the holder the
// container's process and stdio and starts it. A container that is not eligible gets
// a cold reason, which is logged and counted, and is created as usual.
func (c *Controller) Adopt(ctx context.Context, req AdoptRequest) (Adoption, error) {
	sets, err := c.sets(req.Pool)
	if err != nil {
		return Adoption{}, fmt.Errorf("%s=%q: %w", LabelPool, req.Pool, err)
	}
	if err := c.waitReady(ctx); err != nil {
		return Adoption{}, err
	}
	t := sets[0].t
	cold := func(reason string) (Adoption, error) {
		c.metrics.coldFallbacks.WithLabelValues(t.Name, reason).Inc()
		log.G(ctx).WithField("pool", t.Name).WithField("container", req.ContainerID).WithField("reason", reason).Info("pools: container not eligible for a warm member; starting cold")
		return Adoption{ColdReason: reason}, nil
	}
	key, err := c.sn.KeyFromMounts(ctx, req.Rootfs)
	if err != nil {
		return cold("not_a_tidepool_snapshot")
	}
	// The container's namespace picks the member set: its snapshot's parent is the
	// image as unpacked in that namespace, and only a member made there has the same.
	ns := snapshotNamespace(key)
	p := inNamespace(sets, ns)
	if p == nil {
		log.G(ctx).WithField("pool", t.Name).WithField("container", req.ContainerID).WithField("namespaces", t.Namespaces).
			Infof("pools: pool does not serve namespace %q; add it to the pool's namespaces to keep members there", ns)
		return cold("namespace")
	}
	ctx = p.nsContext(ctx)
	info, err := c.sn.Stat(ctx, key)
	if err != nil {
		return Adoption{}, err
	}
	if _, bound := info.Labels["containerd.io/snapshot/tidepool.fork"]; bound {
		return cold("snapshot_has_fork")
	}
	if req.Workdir != "" && filepath.Clean(req.Workdir) != p.t.Workdir {
		return cold("workdir")
	}
	if req.Owner != "" && req.Owner != p.t.Owner {
		return cold("owner")
	}
	if req.Runtime != p.t.Runtime {
		return cold("runtime")
	}
	m := p.lend()
	if m == nil {
		return cold("no_idle_member")
	}
	memberSpec, err := m.container.Spec(ctx)
	if err != nil {
		p.unlend()
		go p.discard(context.WithoutCancel(ctx), m, "error")
		return Adoption{}, err
	}
	if reason := ineligible(withoutSlot(memberSpec, m.slot), req.Spec); reason != "" {
		p.giveBack(m) // nothing touched it
		return cold(reason)
	}
	if reason := c.cgroups.Supported(); reason != "" {
		p.giveBack(m)
		return cold(reason)
	}
	mInfo, err := c.sn.Stat(ctx, m.snapKey)
	if err != nil || mInfo.Parent != info.Parent {
		p.giveBack(m)
		return cold("image")
	}
	// Eligible: the member is the container's from here, and the pool replaces it.
	p.claimLent()
	release := func(reason string) {
		p.release()
		go p.discard(context.WithoutCancel(ctx), m, reason)
	}
	if err := c.sn.CheckLateBind(ctx, m.snapKey); err != nil {
		release("tainted")
		return cold("tainted_member")
	}
	if reason, err := c.moveToContainerCgroup(ctx, m, req.Spec.Linux); reason != "" {
		// The member may be half moved: it never goes back, and the cgroup we made
		// goes with it, so that runc makes the container's own when it starts cold.
		log.G(ctx).WithError(err).WithField("member", m.id).WithField("container", req.ContainerID).Warn("pools: cannot give a member the container's cgroup")
		p.release()
		c.metrics.discarded.WithLabelValues(p.t.Name, reason).Inc()
		p.destroy(context.WithoutCancel(ctx), m)
		return cold(reason)
	}
	if err := c.sn.Rekey(ctx, m.snapKey, key); err != nil {
		release("rekey_failed")
		return Adoption{}, err
	}
	a := Adoption{Member: m.id, ControlSocket: filepath.Join(m.dir, holder.ControlName)}
	// From here the member's data is the container's snapshot; a failure ends the
	// member (its task runs on that data) and the container's create fails.
	m.snapKey = key
	if req.Fork != "" {
		res, err := c.sn.Bind(ctx, snapshotter.BindRequest{Key: key, Fork: req.Fork, Discard: req.Discard})
		if err != nil {
			release("bind_failed")
			return Adoption{}, err
		}
		a.ForkID, a.Root = res.ForkID, res.Root
	} else if m.slot != "" {
		if err := c.sn.OpenSlot(ctx, key); err != nil {
			release("bind_failed")
			return Adoption{}, err
		}
	}
	a.Pid = m.task.Pid()
	ad := &adopted{m: m, container: req.ContainerID, done: make(chan struct{})}
	ad.watch()
	c.mu.Lock()
	if c.adoptions == nil {
		c.adoptions = map[string]*adopted{}
	}
	c.adoptions[m.id] = ad
	c.mu.Unlock()
	go m.container.SetLabels(context.WithoutCancel(ctx), map[string]string{LabelState: stateClaimed, LabelAdoptedBy: req.ContainerID, LabelCgroup: m.movedTo})
	c.metrics.adoptions.WithLabelValues(p.t.Name, p.ns).Inc()
	log.G(ctx).WithField("member", m.id).WithField("container", req.ContainerID).Debug("pools: container adopted a warm member")
	return a, nil
}

func (c *Controller) adoption(member string) (*adopted, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a, ok := c.adoptions[member]
	if !ok {
		return nil, fmt.Errorf("no adopted member %q: %w", member, errdefs.ErrNotFound)
	}
	return a, nil
}

// StartMember thaws an adopted member whose holder has been handed its workload.
func (c *Controller) StartMember(ctx context.Context, member string) error {
	a, err := c.adoption(member)
	if err != nil {
		return err
	}
	ctx = a.m.pool.nsContext(ctx)
	start := time.Now()
	if err := a.m.resume(ctx); err != nil {
		return fmt.Errorf("start member %s: %w", member, err)
	}
	c.metrics.claimSeconds.WithLabelValues(a.m.pool.t.Name).Observe(time.Since(start).Seconds())
	return nil
}

// SignalMember forwards a signal to an adopted member's workload.
func (c *Controller) SignalMember(ctx context.Context, member string, sig syscall.Signal, all bool) error {
	a, err := c.adoption(member)
	if err != nil {
		return err
	}
	ctx = a.m.pool.nsContext(ctx)
	if all && a.m.movedTo != "" {
		// runc would look for them in the member's cgroup, which they left.
		return c.cgroups.Signal(a.m.movedTo, sig)
	}
	var opts []containerd.KillOpts
	if all {
		opts = append(opts, containerd.WithKillAll)
	}
	return a.m.task.Kill(ctx, sig, opts...)
}

// PauseMember freezes or thaws an adopted member.
func (c *Controller) PauseMember(ctx context.Context, member string, pause bool) error {
	a, err := c.adoption(member)
	if err != nil {
		return err
	}
	ctx = a.m.pool.nsContext(ctx)
	if pause {
		return a.m.pause(ctx)
	}
	return a.m.resume(ctx)
}

// WaitMember waits for an adopted member's workload to exit.
func (c *Controller) WaitMember(ctx context.Context, member string) (containerd.ExitStatus, error) {
	a, err := c.adoption(member)
	if err != nil {
		return containerd.ExitStatus{}, err
	}
	select {
	case <-a.done:
		return a.status, nil
	case <-ctx.Done():
		return containerd.ExitStatus{}, ctx.Err()
	}
}

// ReleaseMember destroys an adopted member once its container's task is deleted. Its
// changes are committed when containerd removes the container's snapshot, which after
// the re-key is the member's data, exactly as for a cold container.
func (c *Controller) ReleaseMember(ctx context.Context, member string) error {
	a, err := c.adoption(member)
	if err != nil {
		return err
	}
	ctx = a.m.pool.nsContext(ctx)
	c.mu.Lock()
	delete(c.adoptions, member)
	c.mu.Unlock()
	a.m.pool.release()
	go a.m.pool.destroy(context.WithoutCancel(ctx), a.m)
	return nil
}

// lend takes the oldest idle member, without waiting, for an eligibility check: it
// still counts as the pool's (needMember) until claimLent or giveBack.
func (p *Pool) lend() *Member {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.idle) == 0 {
		return nil
	}
	m := p.idle[0]
	p.idle = p.idle[1:]
	p.lent++
	p.c.claims.took()
	return m
}

// giveBack returns a lent member nothing touched (an eligibility check said no).
func (p *Pool) giveBack(m *Member) {
	p.mu.Lock()
	p.lent--
	p.idle = append([]*Member{m}, p.idle...)
	p.mu.Unlock()
}

// claimLent makes a lent member a claimed one, and asks for its replacement.
func (p *Pool) claimLent() {
	p.mu.Lock()
	p.lent--
	p.claimed++
	p.mu.Unlock()
	p.poke()
}

// unlend forgets a lent member that is being discarded.
func (p *Pool) unlend() {
	p.mu.Lock()
	p.lent--
	p.mu.Unlock()
	p.poke()
}

// snapshotNamespace is the containerd namespace of a snapshot, from its key in the
// tidepool snapshotter: containerd's metadata store names the snapshots it creates
// in a snapshotter "<namespace>/<id>/<key>" (core/metadata/snapshot.go createKey).
func snapshotNamespace(key string) string {
	ns, _, ok := strings.Cut(key, "/")
	if !ok {
		return ""
	}
	return ns
}

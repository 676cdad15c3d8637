package pool

import (
	"context"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/moby/sys/mountinfo"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/pool/holder"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// RunSpec is an explicit claim: which pool, which fork, and the workload.
type RunSpec struct {
	Pool    string
	Fork    string // root hash, fork id or label; "" for none
	Env     []string
	Workdir string // the workload's working directory; "" means the pool's workdir
	Args    []string
	Discard bool // do not commit the workload's changes
}

// RunIO connects the workload to its caller.
type RunIO struct {
	// Stdio, if set, are the workload's stdin, stdout and stderr themselves (the
	// caller's pipes, handed over on the run socket): they go to the holder as they
	// are and nothing is relayed; Run closes them once handed on. Stdin, Stdout and
	// Stderr are then unused.
	Stdio          []*os.File
	Stdin          io.Reader // nil: /dev/null
	Stdout, Stderr io.Writer
	Signals        <-chan syscall.Signal
	// Started, if set, is called once the workload runs, with the member's id.
	Started func(member string)
	// Finished, if set, is called with the result once the workload has exited and
	// its changes are committed, before the member is torn down and the pool refilled:
	// the caller delivers the result first, so teardown stays off its critical path.
	Finished func(RunResult)
}

// Step is one timed stage of a run, for callers that report where the time went.
type Step struct {
	Name     string
	Duration time.Duration
}

// steps times consecutive stages: each mark closes the stage begun at the previous.
type steps struct {
	last time.Time
	list []Step
}

func (s *steps) mark(name string) {
	now := time.Now()
	s.list = append(s.list, Step{Name: name, Duration: now.Sub(s.last)})
	s.last = now
}

// RunResult is how the workload ended and where its changes went.
type RunResult struct {
	Status       int // exit status; 128+N after a death by signal N
	Member       string
	ForkID       string
	Root         casstore.Hash
	ClaimLatency time.Duration
	// Steps are the run's stages in order: ready (pools started), take (an idle
	// member), bind (the fork into its view), exec (the workload to the holder), resume
	// (thaw), workload (until it exited), drain (its last output), commit.
	Steps []Step
}

// claimAttempts bounds how many tainted members one claim may throw away.
const claimAttempts = 3

// Run claims a member, binds the fork, hands the holder the workload with stdio
// descriptors, thaws the member, relays stdio until the workload exits, commits its
// changes to the fork and destroys the member.
func (c *Controller) Run(ctx context.Context, spec RunSpec, rio RunIO) (RunResult, error) {
	var res RunResult
	p, err := c.pool(spec.Pool)
	if err != nil {
		return res, err
	}
	ctx = p.nsContext(ctx)
	if len(spec.Args) == 0 {
		return res, fmt.Errorf("run: no command: %w", errdefs.ErrInvalidArgument)
	}
	cwd := p.t.Workdir
	if spec.Workdir != "" {
		if !path.IsAbs(spec.Workdir) {
			return res, fmt.Errorf("run: workdir %q must be absolute: %w", spec.Workdir, errdefs.ErrInvalidArgument)
		}
		cwd = path.Clean(spec.Workdir)
	}
	for _, kv := range spec.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return res, fmt.Errorf("run: environment entry %q is not KEY=VALUE: %w", kv, errdefs.ErrInvalidArgument)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := steps{last: time.Now()}
	if err := c.waitReady(ctx); err != nil {
		return res, err
	}
	st.mark("ready")
	start := st.last
	m, err := c.claim(ctx, p, spec, &st)
	if err != nil {
		return res, err
	}
	tClaimed := time.Since(start)

	stdio, parent, err := rio.Stdio, []*os.File(nil), error(nil)
	if stdio == nil {
		stdio, parent, err = pipes(rio.Stdin != nil)
	} else if len(stdio) != 3 {
		err = fmt.Errorf("run: %d stdio descriptors, want 3: %w", len(stdio), errdefs.ErrInvalidArgument)
	}
	if err != nil {
		closeAll(rio.Stdio)
		p.destroy(ctx, m)
		p.release()
		return res, err
	}
	defer closeAll(parent)
	wait := m.exited
	err = holder.SendExec(filepath.Join(m.dir, holder.ControlName), m.holderPeer(), holder.ExecRequest{
		Args: spec.Args, Env: mergeEnv(m.env, spec.Env), Cwd: cwd, Fds: true,
	}, stdio)
	closeAll(stdio)
	if err == nil {
		st.mark("exec")
		if err = m.resume(ctx); err == nil {
			st.mark("resume")
		}
	}
	if err != nil {
		p.destroy(ctx, m)
		p.release()
		return res, fmt.Errorf("run in member %s: %w", m.id, err)
	}
	// Only now is there a workload whose status the caller gets; before, an error.
	res.Member = m.id
	res.ClaimLatency = time.Since(start)
	log.G(ctx).WithField("member", m.id).WithField("take_bind", tClaimed).WithField("total", res.ClaimLatency).Debug("pools: claimed")
	c.metrics.claimSeconds.WithLabelValues(p.t.Name).Observe(res.ClaimLatency.Seconds())
	c.metrics.ageAtClaim.WithLabelValues(p.t.Name).Observe(start.Sub(m.created).Seconds())
	go m.container.SetLabels(context.WithoutCancel(ctx), map[string]string{LabelState: stateClaimed})
	if rio.Started != nil {
		rio.Started(m.id)
	}

	var copies sync.WaitGroup
	relay := func(w io.Writer, r *os.File) {
		defer copies.Done()
		if w == nil {
			w = io.Discard
		}
		io.Copy(w, r)
	}
	if parent != nil {
		copies.Add(2)
		go relay(rio.Stdout, parent[1])
		go relay(rio.Stderr, parent[2])
	}
	if parent != nil && rio.Stdin != nil {
		go func() {
			io.Copy(parent[0], rio.Stdin)
			parent[0].Close()
		}()
	}
	var status containerd.ExitStatus
	for done := false; !done; {
		select {
		case status = <-wait:
			m.ended.Store(true)
			done = true
		case sig := <-rio.Signals:
			if err := m.task.Kill(ctx, sig); err != nil {
				log.G(ctx).WithError(err).WithField("member", m.id).Debug("pools: forwarding a signal failed")
			}
		case <-ctx.Done():
			// The caller is gone: the workload goes too, but what it wrote so far is
			// still committed below.
			m.task.Kill(context.WithoutCancel(ctx), syscall.SIGKILL, containerd.WithKillAll)
			status = m.exitStatus()
			done = true
		}
	}
	st.mark("workload")
	copies.Wait()
	st.mark("drain")
	res.Status = int(status.ExitCode())
	bg := context.WithoutCancel(ctx)
	if !spec.Discard {
		res.ForkID, res.Root, err = c.sn.CommitNow(bg, m.snapKey)
		if err != nil {
			log.G(ctx).WithError(err).WithField("member", m.id).Warn("pools: commit failed; the snapshot commits when containerd removes it")
		}
		st.mark("commit")
	}
	res.Steps = st.list
	if rio.Finished != nil {
		rio.Finished(res)
	}
	// Teardown and refill run after the result went out.
	p.release()
	c.teardowns.Add(1)
	go func() {
		defer c.teardowns.Done()
		p.prebuild(bg, m, res.Root)
		p.destroy(bg, m)
	}()
	return res, err
}

// prebuild builds, once claims are quiet, the kernel view of the root a slot
// member's claim committed (its image), so that the fork's next claim mounts it
// without building it; a claim that comes first builds it itself (and one that
// comes during the build waits for it rather than building it twice).
func (p *Pool) prebuild(ctx context.Context, m *Member, root casstore.Hash) {
	if m.slot == "" || root.IsZero() || root == m.boundRoot {
		return
	}
	p.c.claims.yield(ctx, nil)
	if err := p.c.sn.PrebuildSlotView(ctx, root, p.t.Owner); err != nil {
		log.G(ctx).WithError(err).WithField("member", m.id).WithField("root", root.Short()).Debug("pools: could not prebuild the view of a committed root")
	}
}

// claim takes an idle member and binds the fork to its view. A member whose workdir
// was looked up before binding is discarded and another taken.
func (c *Controller) claim(ctx context.Context, p *Pool, spec RunSpec, st *steps) (*Member, error) {
	for attempt := 0; ; attempt++ {
		m, err := p.take(ctx)
		if err != nil {
			return nil, err
		}
		st.mark("take")
		if spec.Fork == "" {
			if m.slot == "" {
				return m, nil
			}
			// No fork: the slot shows what the rootfs would (the image's workdir).
			if err = c.sn.OpenSlot(ctx, m.snapKey); err == nil {
				st.mark("bind")
				return m, nil
			}
			p.release()
			go p.discard(context.WithoutCancel(ctx), m, "bind_failed")
			return nil, fmt.Errorf("open the workdir of member %s: %w", m.id, err)
		}
		var res snapshotter.BindResult
		res, err = c.sn.Bind(ctx, snapshotter.BindRequest{Key: m.snapKey, Fork: spec.Fork, Discard: spec.Discard})
		if err == nil {
			st.mark("bind")
			m.boundRoot = res.Root
			return m, nil
		}
		p.release()
		if errdefs.IsFailedPrecondition(err) && attempt+1 < claimAttempts {
			log.G(ctx).WithError(err).WithField("member", m.id).Warn("pools: discarding a tainted member")
			go p.discard(context.WithoutCancel(ctx), m, "tainted")
			continue
		}
		// Nothing ran in it, but a member a request touched never goes back.
		go p.discard(context.WithoutCancel(ctx), m, "bind_failed")
		return nil, fmt.Errorf("bind fork %q: %w", spec.Fork, err)
	}
}

// pipes makes the workload's stdio: child ends for the holder, parent ends for us.
func pipes(stdin bool) (child, parent []*os.File, err error) {
	child, parent = make([]*os.File, 3), make([]*os.File, 3)
	if stdin {
		if parent[0], child[0], err = reversePipe(); err != nil {
			return nil, nil, err
		}
	} else {
		if child[0], err = os.Open(os.DevNull); err != nil {
			return nil, nil, err
		}
	}
	for i := 1; i < 3; i++ {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll(child)
			closeAll(parent)
			return nil, nil, err
		}
		parent[i], child[i] = r, w
	}
	return child, parent, nil
}

// reversePipe returns (write end, read end): we write the workload's stdin.
func reversePipe() (w, r *os.File, err error) {
	r, w, err = os.Pipe()
	return w, r, err
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// mergeEnv overlays KEY=VALUE entries on a base environment, last one winning.
func mergeEnv(base, over []string) []string {
	out := append([]string(nil), base...)
	for _, kv := range over {
		k, _, _ := strings.Cut(kv, "=")
		replaced := false
		for i, old := range out {
			if strings.HasPrefix(old, k+"=") {
				out[i], replaced = kv, true
			}
		}
		if !replaced {
			out = append(out, kv)
		}
	}
	return out
}

// freezeMember freezes an idle member by its freezer cgroup, leaving the task
// running as far as containerd knows, so that a claim thaws it with one write
// (thawMember) and the shim handles its exit as a running task's: pausing and resuming
// through containerd would each cost a round trip to the shim and an exec of runc on
// the claim's path (the resume; and, for a task that ends while containerd calls it
// paused, another resume before the exit is reported). Members without a cgroup path
// are paused through containerd.
func freezeMember(ctx context.Context, m *Member) error {
	if m.cgroup != "" {
		err := m.pool.c.cgroups.Freeze(m.cgroup)
		if err == nil {
			return nil
		}
		log.G(ctx).WithError(err).WithField("member", m.id).Debug("pools: freezing the member's cgroup failed; pausing through containerd")
	}
	if err := m.task.Pause(ctx); err != nil {
		return err
	}
	m.runcPaused = true
	return nil
}

// thawMember starts a claimed member's processes: by thawing its freezer cgroup
// directly when freezeMember froze it (one write, on cgroup v1 synchronous), else
// through containerd.
func thawMember(ctx context.Context, m *Member) error {
	if m.runcPaused || m.cgroup == "" {
		if err := m.task.Resume(ctx); err != nil {
			return err
		}
		m.runcPaused = false
		return nil
	}
	if dir := freezerDir(); dir != "" {
		state := filepath.Join(dir, filepath.Clean("/"+m.cgroup), "freezer.state")
		if err := os.WriteFile(state, []byte("THAWED"), 0); err == nil {
			return nil
		}
	}
	return m.pool.c.cgroups.Thaw(m.cgroup)
}

var (
	freezerOnce  sync.Once
	freezerMount string
)

// freezerDir is where the cgroup v1 freezer hierarchy is mounted, or "".
func freezerDir() string {
	freezerOnce.Do(func() {
		mounts, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
			if i.FSType != "cgroup" {
				return true, false
			}
			for _, o := range strings.Split(i.VFSOptions, ",") {
				if o == "freezer" {
					return false, true
				}
			}
			return true, false
		})
		if err == nil && len(mounts) > 0 {
			freezerMount = mounts[0].Mountpoint
		}
	})
	return freezerMount
}

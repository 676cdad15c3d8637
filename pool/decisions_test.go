package pool

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestNeedMember: a pool starts a member only below target, at most two at once,
// never past max counting the claimed ones, and not while backing off.
func TestNeedMember(t *testing.T) {
	c, _, _ := testController(t, Template{Target: 3, Max: 5})
	p := c.pools["node"][0]
	for _, tc := range []struct {
		idle, starting, claimed int
		retry                   time.Duration
		want                    bool
	}{
		{0, 0, 0, 0, true},
		{2, 0, 0, 0, true},
		{3, 0, 0, 0, false},           // at target
		{1, 2, 0, 0, false},           // two starting already
		{1, 1, 0, 0, true},            // one starting, below target
		{0, 0, 5, 0, false},           // drained by claims: at max
		{1, 0, 3, 0, true},            // 4 < max
		{2, 0, 3, 0, false},           // idle+claimed = max
		{0, 0, 0, time.Minute, false}, // backing off after a failure
		{0, 0, 0, -time.Second, true}, // back-off over
	} {
		p.mu.Lock()
		p.idle = make([]*Member, tc.idle)
		p.starting, p.claimed, p.retryAt = tc.starting, tc.claimed, time.Now().Add(tc.retry)
		p.mu.Unlock()
		if got := p.needMember(); got != tc.want {
			t.Errorf("idle %d starting %d claimed %d retry in %v: needMember %v, want %v", tc.idle, tc.starting, tc.claimed, tc.retry, got, tc.want)
		}
	}
}

// TestFillBackoff: a member that cannot start (an image not pulled yet) backs the
// pool off, doubling up to 30s; the next success resets it and adds the member.
func TestFillBackoff(t *testing.T) {
	c, _, _ := testController(t, Template{Target: 1})
	p := c.pools["node"][0]
	fail := true
	c.newMember = func(p *Pool, ctx context.Context) (*Member, error) {
		if fail {
			return nil, errFakeStart
		}
		return &Member{id: "node-ok", pool: p, created: time.Now()}, nil
	}
	ctx := context.Background()
	for i, want := range []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second} {
		p.mu.Lock()
		p.starting++
		p.mu.Unlock()
		p.fill(ctx)
		p.mu.Lock()
		backoff, retry, starting := p.backoff, time.Until(p.retryAt), p.starting
		p.mu.Unlock()
		if backoff != want || retry <= 0 || retry > want || starting != 0 {
			t.Fatalf("failure %d: backoff %v (want %v), retry in %v, starting %d", i+1, backoff, want, retry, starting)
		}
		if p.needMember() {
			t.Fatalf("failure %d: a new member would start while backing off", i+1)
		}
	}
	p.mu.Lock()
	p.backoff = 20 * time.Second
	p.starting++
	p.mu.Unlock()
	p.fill(ctx)
	if p.backoff != 30*time.Second {
		t.Fatalf("back-off grew to %v, want the 30s cap", p.backoff)
	}
	fail = false
	p.mu.Lock()
	p.starting++
	p.retryAt = time.Time{}
	p.mu.Unlock()
	p.fill(ctx)
	if p.backoff != 0 || len(p.idle) != 1 || p.idle[0].id != "node-ok" {
		t.Fatalf("after a success: backoff %v, idle %d", p.backoff, len(p.idle))
	}
}

// TestRecycleMaxAge: members idle longer than max_age are destroyed and counted; the
// younger stay, oldest first.
func TestRecycleMaxAge(t *testing.T) {
	c, sn, _ := testController(t, Template{Target: 3, MaxAge: time.Minute})
	member, _ := baseSpec()
	old := addMember(t, c, sn, member, "img", time.Now().Add(-2*time.Minute))
	young := addMember(t, c, sn, member, "img", time.Now().Add(-30*time.Second))
	newest := addMember(t, c, sn, member, "img", time.Now())
	p := c.pools["node"][0]
	p.recycle(context.Background())
	if len(p.idle) != 2 || p.idle[0] != young || p.idle[1] != newest {
		t.Fatalf("idle after recycling: %v", ids(p.idle))
	}
	if !old.container.(*fakeContainer).isDeleted() || young.container.(*fakeContainer).isDeleted() {
		t.Fatal("the wrong member was destroyed")
	}
	if calls := old.task.(*fakeTask).called(); !reflect.DeepEqual(calls, []string{"kill 9", "resume", "delete"}) {
		t.Fatalf("old member's task: %v", calls)
	}
	if n := testutil.ToFloat64(c.metrics.discarded.WithLabelValues("node", "max_age")); n != 1 {
		t.Fatalf("discarded for max_age: %v", n)
	}
}

func ids(ms []*Member) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.id)
	}
	return out
}

// TestTakeWaitsForRefill: an empty pool makes a claim wait (asking for a refill) until
// a member is ready or the claim's context ends; take and release keep the claimed
// count that bounds the pool at max.
func TestTakeWaitsForRefill(t *testing.T) {
	c, sn, _ := testController(t, Template{Target: 1})
	p := c.pools["node"][0]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := p.take(ctx); !errors.Is(err, errNoMember) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("empty pool: %v", err)
	}
	member, _ := baseSpec()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		time.Sleep(20 * time.Millisecond)
		addMember(t, c, sn, member, "img", time.Now())
	}()
	m, err := p.take(context.Background())
	wg.Wait()
	if err != nil || m == nil || p.claimed != 1 || len(p.idle) != 0 {
		t.Fatalf("take: %v, claimed %d, idle %d", err, p.claimed, len(p.idle))
	}
	select {
	case <-p.changed:
	default:
		t.Fatal("taking a member did not ask the pool to refill")
	}
	p.release()
	if p.claimed != 0 {
		t.Fatalf("claimed %d after release", p.claimed)
	}
}

// ctrKey is the snapshot of the container in adoptReq, in namespace "default".
const ctrKey = "default/99/ctr1"

// adoptReq is a container asking for the pool, made to match a member of spec.
func adoptReq(sn *fakeSnapshots, spec *specs.Spec) AdoptRequest {
	sn.mu.Lock()
	sn.infos[ctrKey] = snapshots.Info{Name: ctrKey, Parent: "img", Kind: snapshots.KindActive}
	sn.mu.Unlock()
	return AdoptRequest{
		Pool: "node", ContainerID: "ctr1", Rootfs: []mount.Mount{{Type: "overlay", Source: ctrKey}},
		Spec: spec, Runtime: "runc",
	}
}

// TestAdoptColdReasons: each reason a container starts cold for, with what happens to
// the member: given back untouched when only compared, destroyed once anything was
// done to it. Each fallback is counted under its reason.
func TestAdoptColdReasons(t *testing.T) {
	for _, tc := range []struct {
		reason string
		setup  func(c *Controller, sn *fakeSnapshots, cg *fakeCgroups, req *AdoptRequest, m *Member)
		kept   bool // the member went back to the pool
	}{
		{"not_a_tidepool_snapshot", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) {
			r.Rootfs = []mount.Mount{{Type: "bind", Source: "/x"}}
		}, true},
		{"snapshot_has_fork", func(_ *Controller, sn *fakeSnapshots, _ *fakeCgroups, _ *AdoptRequest, _ *Member) {
			info := sn.infos[ctrKey]
			info.Labels = map[string]string{"containerd.io/snapshot/tidepool.fork": "abc"}
			sn.infos[ctrKey] = info
		}, true},
		{"workdir", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) {
			r.Workdir = "/elsewhere"
		}, true},
		{"owner", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) {
			r.Owner = "1000:1000"
		}, true},
		{"runtime", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) { r.Runtime = "runsc" }, true},
		{"no_idle_member", func(c *Controller, _ *fakeSnapshots, _ *fakeCgroups, _ *AdoptRequest, _ *Member) {
			c.pools["node"][0].idle = nil
		}, false},
		{"user", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) {
			r.Spec.Process.User.UID = 1000
		}, true},
		{"mounts", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) {
			r.Spec.Mounts = append(r.Spec.Mounts, specs.Mount{Destination: "/host", Source: "/", Type: "bind"})
		}, true},
		{"cgroups_path_systemd", func(_ *Controller, _ *fakeSnapshots, _ *fakeCgroups, r *AdoptRequest, _ *Member) {
			r.Spec.Linux.CgroupsPath = "kubepods.slice:cri-containerd:ctr1"
		}, true},
		{"cgroup_v2", func(_ *Controller, _ *fakeSnapshots, cg *fakeCgroups, _ *AdoptRequest, _ *Member) {
			cg.supported = "cgroup_v2"
		}, true},
		{"image", func(_ *Controller, sn *fakeSnapshots, _ *fakeCgroups, _ *AdoptRequest, m *Member) {
			info := sn.infos[m.snapKey]
			info.Parent = "other-image"
			sn.infos[m.snapKey] = info
		}, true},
		{"tainted_member", func(_ *Controller, sn *fakeSnapshots, _ *fakeCgroups, _ *AdoptRequest, m *Member) {
			sn.tainted[m.snapKey] = true
		}, false},
		{"cgroups_path_in_use", func(_ *Controller, _ *fakeSnapshots, cg *fakeCgroups, _ *AdoptRequest, _ *Member) {
			cg.moveErr = fmt.Errorf("x: %w", errCgroupInUse)
		}, false},
		{"cgroup_apply_failed", func(_ *Controller, _ *fakeSnapshots, cg *fakeCgroups, _ *AdoptRequest, _ *Member) {
			cg.moveErr = errors.New("write memory.limit_in_bytes: device or resource busy")
		}, false},
	} {
		t.Run(tc.reason, func(t *testing.T) {
			c, sn, cg := testController(t, Template{})
			mspec, rspec := baseSpec()
			m := addMember(t, c, sn, mspec, "img", time.Now())
			req := adoptReq(sn, rspec)
			tc.setup(c, sn, cg, &req, m)
			a, err := c.Adopt(context.Background(), req)
			if err != nil || a.ColdReason != tc.reason || a.Member != "" {
				t.Fatalf("adoption %+v, %v; want cold %q", a, err, tc.reason)
			}
			if n := testutil.ToFloat64(c.metrics.coldFallbacks.WithLabelValues("node", tc.reason)); n != 1 {
				t.Fatalf("cold fallbacks counted for %s: %v", tc.reason, n)
			}
			p := c.pools["node"][0]
			waitDestroyed := func() bool {
				for i := 0; i < 200 && !m.container.(*fakeContainer).isDeleted(); i++ {
					time.Sleep(5 * time.Millisecond)
				}
				return m.container.(*fakeContainer).isDeleted()
			}
			switch {
			case tc.reason == "no_idle_member":
			case tc.kept:
				if len(p.idle) != 1 || p.idle[0] != m || p.claimed != 0 || p.lent != 0 || m.container.(*fakeContainer).isDeleted() {
					t.Fatalf("member not given back untouched: idle %v, claimed %d", ids(p.idle), p.claimed)
				}
			default:
				if len(p.idle) != 0 || p.claimed != 0 || p.lent != 0 || !waitDestroyed() {
					t.Fatalf("a touched member must be destroyed: idle %v, claimed %d", ids(p.idle), p.claimed)
				}
			}
			if len(sn.rekeyed) != 0 || len(sn.bound) != 0 {
				t.Fatalf("a cold container's snapshot was re-keyed or bound: %v %v", sn.rekeyed, sn.bound)
			}
			if tc.reason == "cgroup_apply_failed" {
				if ops := cg.done(); !contains(ops, "delete /tidepool/ctr-1") {
					t.Fatalf("the half-made cgroup was not removed: %v", ops)
				}
			}
			if tc.reason == "cgroups_path_in_use" {
				if ops := cg.done(); contains(ops, "delete /tidepool/ctr-1") {
					t.Fatalf("someone else's cgroup was removed: %v", ops)
				}
			}
		})
	}
}

// TestLentMemberCounted: while an adoption checks whether a
// container may take a member (reading the member's spec from containerd), the pool
// does not start a replacement, so a member given back (here: an extra mount) does
// not leave the pool above target for good. Once the container is eligible the
// member is claimed and the pool refills at once.
func TestLentMemberCounted(t *testing.T) {
	for _, eligible := range []bool{false, true} {
		name := map[bool]string{false: "cold", true: "adopted"}[eligible]
		t.Run(name, func(t *testing.T) {
			c, sn, _ := testController(t, Template{Target: 1, Max: 3})
			p := c.pools["node"][0]
			mspec, rspec := baseSpec()
			m := addMember(t, c, sn, mspec, "img", time.Now())
			needed := true
			m.container.(*fakeContainer).onSpec = func() { needed = p.needMember() }
			req := adoptReq(sn, rspec)
			if !eligible {
				req.Spec.Mounts = append(req.Spec.Mounts, specs.Mount{Destination: "/host", Source: "/", Type: "bind"})
			}
			select { // drop what setting up may have signalled
			case <-p.changed:
			default:
			}
			a, err := c.Adopt(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			if needed {
				t.Fatal("the pool would start a replacement for a member still under its eligibility check")
			}
			if !eligible {
				if a.ColdReason != "mounts" || len(p.idle) != 1 || p.lent != 0 || p.needMember() {
					t.Fatalf("cold %q: idle %d, lent %d, needMember %v; want the member back and nothing to start", a.ColdReason, len(p.idle), p.lent, p.needMember())
				}
				return
			}
			if a.Member != m.id || len(p.idle) != 0 || p.lent != 0 || p.claimed != 1 || !p.needMember() {
				t.Fatalf("adopted %q: idle %d, lent %d, claimed %d, needMember %v", a.Member, len(p.idle), p.lent, p.claimed, p.needMember())
			}
			select {
			case <-p.changed:
			default:
				t.Fatal("an adoption did not ask the pool to refill")
			}
		})
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// TestAdoptAppliesCgroup: a container that asks for a memory limit adopts a member
// whose template had another: the member's processes move, frozen, into a cgroup at
// the container's own path made with the container's resources; start thaws it,
// pause and signals to all reach it there, and release removes it.
func TestAdoptAppliesCgroup(t *testing.T) {
	c, sn, cg := testController(t, Template{})
	mspec, rspec := baseSpec()
	limit := int64(64 << 20)
	rspec.Linux.Resources = &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}}
	m := addMember(t, c, sn, mspec, "img", time.Now())
	req := adoptReq(sn, rspec)
	req.Fork = "abc"
	memberKey := m.snapKey
	ctx := context.Background()
	a, err := c.Adopt(ctx, req)
	if err != nil || a.ColdReason != "" || a.Member != m.id || a.Pid != m.task.Pid() {
		t.Fatalf("adoption %+v, %v", a, err)
	}
	if got := cg.moved["/tidepool/ctr-1"]; !reflect.DeepEqual(got, []int{int(m.task.Pid())}) {
		t.Fatalf("moved %v into the container's cgroup, want the member's pid", got)
	}
	if got := cg.res["/tidepool/ctr-1"]; got == nil || *got.Memory.Limit != limit {
		t.Fatalf("container cgroup made with %+v, want its own memory limit", got)
	}
	if !reflect.DeepEqual(sn.rekeyed, [][2]string{{memberKey, ctrKey}}) || len(sn.bound) != 1 || sn.bound[0].Key != ctrKey {
		t.Fatalf("rekeyed %v, bound %v", sn.rekeyed, sn.bound)
	}
	if m.holderPeer().Cgroup != "/tidepool/ctr-1" {
		t.Fatalf("the holder is expected in %q", m.holderPeer().Cgroup)
	}
	if err := c.StartMember(ctx, m.id); err != nil {
		t.Fatal(err)
	}
	if err := c.PauseMember(ctx, m.id, true); err != nil {
		t.Fatal(err)
	}
	if err := c.SignalMember(ctx, m.id, 15, true); err != nil {
		t.Fatal(err)
	}
	if err := c.ReleaseMember(ctx, m.id); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 200 && !contains(cg.done(), "delete /tidepool/ctr-1"); i++ {
		time.Sleep(5 * time.Millisecond)
	}
	want := []string{"move /tidepool/ctr-1", "thaw /tidepool/ctr-1", "freeze /tidepool/ctr-1", "signal 15 /tidepool/ctr-1",
		"signal 9 /tidepool/ctr-1", "thaw /tidepool/ctr-1", "delete /tidepool/ctr-1"}
	if got := cg.done(); !reflect.DeepEqual(got, want) {
		t.Fatalf("cgroup operations\n got %s\nwant %s", strings.Join(got, ", "), strings.Join(want, ", "))
	}
	if calls := m.task.(*fakeTask).called(); !reflect.DeepEqual(calls, []string{"resume", "pause", "kill 9", "resume", "delete"}) {
		t.Fatalf("member task calls %v", calls)
	}
}

// TestDestroyRemovesCgroupOfUnstartedMember: a member whose task create failed, or
// was cut short by a killed tidepoold, has no task, but runc may have made its
// cgroup: destroying it (in the pool, or at reconcile) kills what is left in that
// cgroup and removes it. A member with a task leaves its cgroup to runc's delete;
// a systemd-style path is not touched.
func TestDestroyRemovesCgroupOfUnstartedMember(t *testing.T) {
	c, sn, cg := testController(t, Template{})
	spec := &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/default/m-unstarted"}}

	// In the pool: create failed before a task existed.
	m := newFakeMember(t, c.pools["node"][0], sn, spec, "p", time.Now())
	m.task, m.cgroup = nil, "/default/m-unstarted"
	c.pools["node"][0].destroy(context.Background(), m)
	if got, want := cg.done(), []string{"signal 9 /default/m-unstarted", "thaw /default/m-unstarted", "delete /default/m-unstarted"}; !slices.Equal(got, want) {
		t.Fatalf("destroy without a task: cgroup ops %q, want %q", got, want)
	}
	if !m.container.(*fakeContainer).isDeleted() {
		t.Fatal("the container was not deleted")
	}

	// At reconcile: a left container with no task.
	cg.ops = nil
	ctr := &fakeContainer{id: "m2", spec: &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/default/m2"}}}
	c.destroyContainer(context.Background(), ctr)
	if got, want := cg.done(), []string{"signal 9 /default/m2", "thaw /default/m2", "delete /default/m2"}; !slices.Equal(got, want) {
		t.Fatalf("reconcile without a task: cgroup ops %q, want %q", got, want)
	}

	// With a task, runc's delete removes the cgroup: only the thaw after the kill.
	cg.ops = nil
	task := newFakeTask(42)
	ctr = &fakeContainer{id: "m3", spec: &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/default/m3"}}, task: task}
	c.destroyContainer(context.Background(), ctr)
	if got, want := cg.done(), []string{"thaw /default/m3"}; !slices.Equal(got, want) {
		t.Fatalf("reconcile with a task: cgroup ops %q, want %q", got, want)
	}
	if calls := task.called(); !slices.Contains(calls, "delete") {
		t.Fatalf("task calls %q: not deleted", calls)
	}

	// systemd's slice:prefix:name is no cgroupfs path.
	cg.ops = nil
	c.destroyContainer(context.Background(), &fakeContainer{id: "m4", spec: &specs.Spec{Linux: &specs.Linux{CgroupsPath: "system.slice:tp:m4"}}})
	if got := cg.done(); len(got) != 0 {
		t.Fatalf("systemd path: cgroup ops %q", got)
	}
}

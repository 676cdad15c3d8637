package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// The fakes stand in for containerd and the snapshotter in unit tests, which run
// without root; each records what was asked of it. Embedding the client's
// interfaces makes any method the pool starts using, and a fake lacks, fail loudly.

type fakeTask struct {
	containerd.Task
	pid    uint32
	mu     sync.Mutex
	calls  []string
	exitCh chan containerd.ExitStatus
	once   sync.Once
}

func newFakeTask(pid uint32) *fakeTask {
	return &fakeTask{pid: pid, exitCh: make(chan containerd.ExitStatus, 1)}
}

func (t *fakeTask) record(c string) {
	t.mu.Lock()
	t.calls = append(t.calls, c)
	t.mu.Unlock()
}

func (t *fakeTask) called() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.calls...)
}

func (t *fakeTask) ID() string                   { return fmt.Sprint("task-", t.pid) }
func (t *fakeTask) Pid() uint32                  { return t.pid }
func (t *fakeTask) Pause(context.Context) error  { t.record("pause"); return nil }
func (t *fakeTask) Resume(context.Context) error { t.record("resume"); return nil }
func (t *fakeTask) Pids(context.Context) ([]containerd.ProcessInfo, error) {
	return []containerd.ProcessInfo{{Pid: t.pid}}, nil
}
func (t *fakeTask) Kill(_ context.Context, sig syscall.Signal, _ ...containerd.KillOpts) error {
	t.record(fmt.Sprint("kill ", int(sig)))
	if sig == syscall.SIGKILL {
		t.once.Do(func() { t.exitCh <- *containerd.NewExitStatus(137, time.Now(), nil); close(t.exitCh) })
	}
	return nil
}
func (t *fakeTask) Wait(context.Context) (<-chan containerd.ExitStatus, error) { return t.exitCh, nil }
func (t *fakeTask) Delete(context.Context, ...containerd.ProcessDeleteOpts) (*containerd.ExitStatus, error) {
	t.record("delete")
	return containerd.NewExitStatus(137, time.Now(), nil), nil
}

type fakeContainer struct {
	containerd.Container
	id      string
	spec    *specs.Spec
	mu      sync.Mutex
	labels  map[string]string
	task    containerd.Task
	deleted bool
	onSpec  func() // runs while Spec is read, as a containerd call would leave time to
}

func (c *fakeContainer) ID() string { return c.id }
func (c *fakeContainer) Labels(context.Context) (map[string]string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	l := map[string]string{}
	for k, v := range c.labels {
		l[k] = v
	}
	return l, nil
}

// Task: a fake container has a task only when one was given.
func (c *fakeContainer) Task(context.Context, cio.Attach) (containerd.Task, error) {
	if c.task == nil {
		return nil, fmt.Errorf("no task for container %s: %w", c.id, errdefs.ErrNotFound)
	}
	return c.task, nil
}
func (c *fakeContainer) Spec(context.Context) (*oci.Spec, error) {
	if c.onSpec != nil {
		c.onSpec()
	}
	return clone(c.spec), nil
}
func (c *fakeContainer) SetLabels(_ context.Context, l map[string]string) (map[string]string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.labels == nil {
		c.labels = map[string]string{}
	}
	for k, v := range l {
		c.labels[k] = v
	}
	return c.labels, nil
}
func (c *fakeContainer) Delete(context.Context, ...containerd.DeleteOpts) error {
	c.mu.Lock()
	c.deleted = true
	c.mu.Unlock()
	return nil
}
func (c *fakeContainer) isDeleted() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deleted
}

// fakeSnapshots keys snapshots by the source of their first mount.
type fakeSnapshots struct {
	mu       sync.Mutex
	infos    map[string]snapshots.Info
	tainted  map[string]bool
	rekeyed  [][2]string
	bound    []snapshotter.BindRequest
	rekeyErr error
}

func (s *fakeSnapshots) KeyFromMounts(_ context.Context, m []mount.Mount) (string, error) {
	if len(m) != 1 || m[0].Type != "overlay" {
		return "", fmt.Errorf("not ours: %w", errdefs.ErrInvalidArgument)
	}
	return m[0].Source, nil
}

func (s *fakeSnapshots) Stat(_ context.Context, key string) (snapshots.Info, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	info, ok := s.infos[key]
	if !ok {
		return info, fmt.Errorf("snapshot %s: %w", key, errdefs.ErrNotFound)
	}
	return info, nil
}

func (s *fakeSnapshots) CheckLateBind(_ context.Context, key string) error {
	if s.tainted[key] {
		return fmt.Errorf("tainted: %w", errdefs.ErrFailedPrecondition)
	}
	return nil
}

func (s *fakeSnapshots) SlotDir(_ context.Context, key string) (string, error) {
	return "/slots/" + key, nil
}

func (s *fakeSnapshots) OpenSlot(context.Context, string) error { return nil }

func (s *fakeSnapshots) PrebuildSlotView(context.Context, casstore.Hash, string) error { return nil }

func (s *fakeSnapshots) Rekey(_ context.Context, from, to string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rekeyed = append(s.rekeyed, [2]string{from, to})
	return s.rekeyErr
}

func (s *fakeSnapshots) Bind(_ context.Context, req snapshotter.BindRequest) (snapshotter.BindResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.bound = append(s.bound, req)
	return snapshotter.BindResult{ForkID: "f1"}, nil
}

func (s *fakeSnapshots) CommitNow(context.Context, string) (string, casstore.Hash, error) {
	return "f1", casstore.Hash{}, nil
}

type fakeCgroups struct {
	mu        sync.Mutex
	supported string
	moveErr   error
	moved     map[string][]int
	res       map[string]*specs.LinuxResources
	ops       []string
}

func (f *fakeCgroups) Supported() string { return f.supported }
func (f *fakeCgroups) Move(path string, res *specs.LinuxResources, pids []int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.moveErr != nil {
		return f.moveErr
	}
	if f.moved == nil {
		f.moved, f.res = map[string][]int{}, map[string]*specs.LinuxResources{}
	}
	f.moved[path], f.res[path] = pids, res
	f.ops = append(f.ops, "move "+path)
	return nil
}
func (f *fakeCgroups) op(s string) error {
	f.mu.Lock()
	f.ops = append(f.ops, s)
	f.mu.Unlock()
	return nil
}
func (f *fakeCgroups) Freeze(path string) error { return f.op("freeze " + path) }
func (f *fakeCgroups) Thaw(path string) error   { return f.op("thaw " + path) }
func (f *fakeCgroups) Signal(path string, s syscall.Signal) error {
	return f.op(fmt.Sprint("signal ", int(s), " ", path))
}
func (f *fakeCgroups) Delete(path string) error { return f.op("delete " + path) }
func (f *fakeCgroups) done() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.ops...)
}

var errFakeStart = errors.New("image not pulled yet")

// testController is a controller over fakes with one pool, "node", ready for claims.
func testController(t *testing.T, tmpl Template) (*Controller, *fakeSnapshots, *fakeCgroups) {
	t.Helper()
	dir := t.TempDir()
	holderBin := filepath.Join(dir, "tidepool-holder")
	if err := os.WriteFile(holderBin, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	sn := &fakeSnapshots{infos: map[string]snapshots.Info{}, tainted: map[string]bool{}}
	if tmpl.Name == "" {
		tmpl.Name = "node"
	}
	if tmpl.Image == "" {
		tmpl.Image = "example.com/node:1"
	}
	c, err := NewController(Config{StateDir: filepath.Join(dir, "pools"), Holder: holderBin, Templates: []Template{tmpl}}, sn)
	if err != nil {
		t.Fatal(err)
	}
	cg := &fakeCgroups{}
	c.cgroups = cg
	close(c.ready)
	return c, sn, cg
}

var memberSeq atomic.Int64

// addMember puts an idle member made from spec into the pool's first member set
// (namespace "default"), its snapshot a child of parent.
func addMember(t *testing.T, c *Controller, sn *fakeSnapshots, spec *specs.Spec, parent string, created time.Time) *Member {
	t.Helper()
	return addMemberTo(t, c.pools["node"][0], sn, spec, parent, created)
}

// addMemberTo puts an idle member into one member set; its snapshot is keyed as
// containerd's metadata store keys snapshots in a snapshotter ("<ns>/<id>/<name>").
func addMemberTo(t *testing.T, p *Pool, sn *fakeSnapshots, spec *specs.Spec, parent string, created time.Time) *Member {
	t.Helper()
	m := newFakeMember(t, p, sn, spec, parent, created)
	p.mu.Lock()
	p.idle = append(p.idle, m)
	p.mu.Unlock()
	return m
}

// newFakeMember makes a member of p (as Pool.create would) without adding it.
func newFakeMember(t *testing.T, p *Pool, sn *fakeSnapshots, spec *specs.Spec, parent string, created time.Time) *Member {
	t.Helper()
	seq := memberSeq.Add(1)
	id := fmt.Sprintf("%snode-%d", MemberIDPrefix, seq)
	m := &Member{
		id: id, pool: p, created: created, dir: filepath.Join(p.c.cfg.StateDir, id), snapKey: fmt.Sprintf("%s/%d/%s", p.ns, seq, id),
		container: &fakeContainer{id: id, spec: spec}, task: newFakeTask(uint32(1000 + seq)),
	}
	m.exited = m.task.(*fakeTask).exitCh
	if err := os.MkdirAll(m.dir, 0o700); err != nil {
		t.Fatal(err)
	}
	sn.mu.Lock()
	sn.infos[m.snapKey] = snapshots.Info{Name: m.snapKey, Parent: parent, Kind: snapshots.KindActive}
	sn.mu.Unlock()
	return m
}

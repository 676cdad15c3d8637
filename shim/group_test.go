package shim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	taskapi "github.com/containerd/containerd/api/runtime/task/v3"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/tidepool-dev/tidepool/binding"
)

func TestGroupName(t *testing.T) {
	for _, c := range []struct {
		ann   map[string]string
		name  string
		grace time.Duration
		err   string
	}{
		{ann: nil},
		{ann: map[string]string{binding.AnnotationShimGroupGrace: "1s"}}, // grace alone: not grouped
		{ann: map[string]string{binding.AnnotationShimGroup: "pool.a.0"}, name: "pool.a.0", grace: DefaultGroupGrace},
		{ann: map[string]string{binding.AnnotationShimGroup: "g", binding.AnnotationShimGroupGrace: "0s"}, name: "g"},
		{ann: map[string]string{binding.AnnotationShimGroup: "g", binding.AnnotationShimGroupGrace: "soon"}, err: binding.AnnotationShimGroupGrace},
		{ann: map[string]string{binding.AnnotationShimGroup: "g", binding.AnnotationShimGroupGrace: "-1s"}, err: binding.AnnotationShimGroupGrace},
		{ann: map[string]string{binding.AnnotationShimGroup: "g", binding.AnnotationShimGroupGrace: "2h"}, err: binding.AnnotationShimGroupGrace},
		{ann: map[string]string{binding.AnnotationShimGroup: strings.Repeat("x", 129)}, err: binding.AnnotationShimGroup},
	} {
		name, grace, err := groupName(c.ann)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%v: error %v, want one naming %s", c.ann, err, c.err)
			}
			continue
		}
		if err != nil || name != c.name || grace != c.grace {
			t.Errorf("%v: got %q %v %v, want %q %v", c.ann, name, grace, err, c.name, c.grace)
		}
	}
}

func TestGroupStatePathIsPerContainerdNamespaceAndGroup(t *testing.T) {
	a := groupStatePath("/s", "/c.sock", "ns", "g")
	for _, b := range []string{groupStatePath("/s", "/d.sock", "ns", "g"), groupStatePath("/s", "/c.sock", "ns2", "g"), groupStatePath("/s", "/c.sock", "ns", "h")} {
		if a == b {
			t.Fatalf("two groups share %s", a)
		}
	}
	if p := groupStatePath("/s", "/c.sock", "ns", "../../etc/passwd"); filepath.Dir(p) != "/s/"+groupDirName {
		t.Fatalf("group name escaped the state directory: %s", p)
	}
}

// A waiter on a state file that its holder removes takes the lock on the path's new
// file, never on the removed one (two lockers would then hold "the" lock at once).
func TestLockGroupFollowsRemoval(t *testing.T) {
	path := filepath.Join(t.TempDir(), groupDirName, "g.json")
	first, err := lockGroup(path)
	if err != nil {
		t.Fatal(err)
	}
	first.state.Address = "unix:///old"
	if err := first.save(); err != nil {
		t.Fatal(err)
	}
	got := make(chan *lockedGroup)
	go func() {
		g, err := lockGroup(path)
		if err != nil {
			t.Error(err)
		}
		got <- g
	}()
	time.Sleep(50 * time.Millisecond)
	select {
	case <-got:
		t.Fatal("two holders of one group lock")
	default:
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	first.unlock()
	second := <-got
	defer second.unlock()
	if second.state.Address != "" {
		t.Fatalf("waiter read the removed state: %+v", second.state)
	}
	// A third locker now waits on the same (new) file as the second holds.
	third := make(chan struct{})
	go func() {
		g, err := lockGroup(path)
		if err == nil {
			g.unlock()
		}
		close(third)
	}()
	select {
	case <-third:
		t.Fatal("the new file's lock is not exclusive")
	case <-time.After(50 * time.Millisecond):
	}
	second.unlock()
	<-third
}

func TestSaveDropsStartsThatCannotArrive(t *testing.T) {
	dir := t.TempDir()
	g, err := lockGroup(filepath.Join(dir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.unlock()
	bundle := filepath.Join(dir, "bundle")
	os.Mkdir(bundle, 0o700)
	now := time.Now()
	g.pending("fresh", pendingStart{Address: "a", Bundle: bundle, At: now})
	g.pending("old", pendingStart{Address: "a", Bundle: bundle, At: now.Add(-pendingTTL - time.Second)})
	g.pending("gone", pendingStart{Address: "a", Bundle: filepath.Join(dir, "removed"), At: now})
	if err := g.save(); err != nil {
		t.Fatal(err)
	}
	if len(g.state.Pending) != 1 || g.state.Pending["fresh"].Bundle != bundle {
		t.Fatalf("pending after save: %+v", g.state.Pending)
	}
}

// fakeRunc stands for containerd's runc task service: it records shutdowns.
type fakeRunc struct {
	taskapi.TTRPCTaskService
	mu        sync.Mutex
	shutdowns int
}

func (f *fakeRunc) Shutdown(context.Context, *taskapi.ShutdownRequest) (*emptypb.Empty, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.shutdowns++
	return &emptypb.Empty{}, nil
}

func (f *fakeRunc) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.shutdowns
}

func groupedService(t *testing.T, self string) (*TaskService, *fakeRunc, string, string) {
	dir := t.TempDir()
	state := filepath.Join(dir, groupDirName, "g.json")
	bundle := filepath.Join(dir, "bundle")
	if err := os.Mkdir(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	f := &fakeRunc{}
	s := &TaskService{TTRPCTaskService: f, self: self,
		group: &shimGroup{rec: groupRecord{Group: "g", State: state, Grace: time.Hour}, self: self}}
	return s, f, state, bundle
}

func writeState(t *testing.T, path string, st groupState) {
	t.Helper()
	g, err := lockGroup(path)
	if err != nil {
		t.Fatal(err)
	}
	defer g.unlock()
	g.state = st
	if err := g.save(); err != nil {
		t.Fatal(err)
	}
}

func readState(t *testing.T, path string) groupState {
	t.Helper()
	g, err := lockGroup(path)
	if err != nil {
		t.Fatal(err)
	}
	defer g.unlock()
	return g.state
}

// The decisions of a grouped shim whose keep-alive ran out.
func TestLeaveGroup(t *testing.T) {
	const self, other = "unix:///run/s/self", "unix:///run/s/other"
	t.Run("a start on its way keeps it", func(t *testing.T) {
		s, f, state, bundle := groupedService(t, self)
		writeState(t, state, groupState{Address: self, Pending: map[string]pendingStart{"m2": {Address: self, Bundle: bundle, At: time.Now()}}})
		s.leaveGroup()
		if f.count() != 0 || readState(t, state).Address != self {
			t.Fatalf("left with a start on its way: %d shutdowns, state %+v", f.count(), readState(t, state))
		}
		// Its create arrives (joinGroup clears the pending start), then goes.
		os.WriteFile(filepath.Join(bundle, groupRecordFile), []byte(`{"group":"g","state":"`+state+`","grace":3600000000000}`), 0o600)
		if err := s.joinGroup(context.Background(), "m2", bundle); err != nil {
			t.Fatal(err)
		}
		if p := readState(t, state).Pending; len(p) != 0 {
			t.Fatalf("pending start not cleared at create: %+v", p)
		}
		s.leaveGroup()
		if f.count() != 1 {
			t.Fatalf("%d shutdowns, want 1", f.count())
		}
		if _, err := os.Stat(state); !os.IsNotExist(err) {
			t.Fatalf("state of the emptied group left: %v", err)
		}
		s.idle(0) // a late shutdown request changes nothing once exiting
		time.Sleep(300 * time.Millisecond)
		if f.count() != 1 {
			t.Fatalf("%d shutdowns, want 1", f.count())
		}
	})
	t.Run("a container keeps it", func(t *testing.T) {
		s, f, state, _ := groupedService(t, self)
		writeState(t, state, groupState{Address: self})
		s.inflight = 1
		s.leaveGroup()
		s.inflight = 0
		s.bundles = map[string]string{"m": "/b"}
		s.leaveGroup()
		if f.count() != 0 || readState(t, state).Address != self {
			t.Fatalf("left while serving: %d shutdowns", f.count())
		}
	})
	t.Run("another shim's record is left alone", func(t *testing.T) {
		s, f, state, bundle := groupedService(t, self)
		writeState(t, state, groupState{Address: other, Pending: map[string]pendingStart{"m3": {Address: other, Bundle: bundle, At: time.Now()}}})
		s.leaveGroup()
		if f.count() != 1 {
			t.Fatalf("%d shutdowns, want 1", f.count())
		}
		if st := readState(t, state); st.Address != other || len(st.Pending) != 1 {
			t.Fatalf("another shim's record changed: %+v", st)
		}
	})
	t.Run("the last to leave removes an empty state", func(t *testing.T) {
		// Another shim was recorded and left first; this one, no longer recorded,
		// leaves last and must not leave the (empty) state behind.
		s, f, state, _ := groupedService(t, self)
		writeState(t, state, groupState{})
		s.leaveGroup()
		if f.count() != 1 {
			t.Fatalf("%d shutdowns, want 1", f.count())
		}
		if _, err := os.Stat(state); !os.IsNotExist(err) {
			t.Fatalf("empty group state left: %v", err)
		}
	})
	t.Run("a stale start does not keep it", func(t *testing.T) {
		s, f, state, bundle := groupedService(t, self)
		writeState(t, state, groupState{Address: self, Pending: map[string]pendingStart{"m4": {Address: self, Bundle: bundle, At: time.Now()}}})
		os.Remove(bundle) // containerd gave up on that container
		s.leaveGroup()
		if f.count() != 1 {
			t.Fatalf("%d shutdowns, want 1", f.count())
		}
	})
}

// The keep-alive: an empty grouped shim leaves after its grace, not before, and a
// create within the grace keeps it.
func TestIdleGrace(t *testing.T) {
	s, f, state, _ := groupedService(t, "unix:///self")
	s.group.rec.Grace = 200 * time.Millisecond
	writeState(t, state, groupState{Address: "unix:///self"})
	s.idle(0)
	time.Sleep(50 * time.Millisecond)
	s.mu.Lock()
	s.inflight++ // a create arrives within the grace
	s.mu.Unlock()
	time.Sleep(400 * time.Millisecond)
	if f.count() != 0 {
		t.Fatal("left with a create under way")
	}
	s.mu.Lock()
	s.inflight--
	s.mu.Unlock()
	s.idle(0)
	deadline := time.Now().Add(5 * time.Second)
	for f.count() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if f.count() != 1 {
		t.Fatalf("%d shutdowns after the grace, want 1", f.count())
	}
}

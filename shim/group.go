package shim

// Shim groups: one shim process serves many containers (warm pool members), as
// containerd's runc shim does for a group label or a pod's sandbox id. Upstream's
// grouped shim exits when its last container is deleted, so a create that was just
// handed that shim's address can land on a shim that is going away. Here the group's
// start and the shim's exit are serialised by a lock on the group's state file:
//
//   - Start, under the lock, reuses the recorded shim only if it answers, and records
//     a pending start for it; otherwise it starts a fresh shim (containerd's runc
//     manager, keyed by the container's own id) and records that one.
//   - The shim, once it serves nothing, waits out the group's grace (the keep-alive
//     a draining pool refills into), then, under the lock, leaves only if it still
//     serves nothing and no pending start names it: it removes the record first, so
//     every later start makes a fresh shim, and only then shuts down.
//
// A create therefore lands in a shim that cannot leave before it arrives, or in a new
// one; it never meets a shim on its way out.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	taskapi "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/defaults"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/binding"
)

const (
	// groupRecordFile, in a grouped container's bundle, tells the shim which group
	// it serves and where the group's state is.
	groupRecordFile = "tidepool-group.json"
	// groupDirName holds the groups' state files, beside containerd's shim sockets.
	groupDirName = "tidepool-groups"
	// DefaultGroupGrace is the keep-alive of a group's shim without the annotation.
	DefaultGroupGrace = 5 * time.Second
	// pendingTTL bounds how long a recorded start keeps a shim up without its
	// create arriving (containerd sends the create right after start returns).
	pendingTTL = 2 * time.Minute
)

// groupRecord is written into the bundle by Start and read by the shim at Create.
type groupRecord struct {
	Group string        `json:"group"`
	State string        `json:"state"`
	Grace time.Duration `json:"grace"`
}

// groupState is the group's state file: the shim that serves it and the starts that
// were handed a shim's address but whose create has not reached it yet.
type groupState struct {
	Address string                  `json:"address,omitempty"`
	Pending map[string]pendingStart `json:"pending,omitempty"`
}

type pendingStart struct {
	Address string    `json:"address"`
	Bundle  string    `json:"bundle"`
	At      time.Time `json:"at"`
}

// live says whether a pending start may still reach its shim.
func (p pendingStart) live(now time.Time) bool {
	if now.Sub(p.At) > pendingTTL {
		return false
	}
	_, err := os.Stat(p.Bundle)
	return err == nil
}

// groupName validates the annotations of a grouped container.
func groupName(ann map[string]string) (name string, grace time.Duration, err error) {
	name = ann[binding.AnnotationShimGroup]
	if name == "" {
		return "", 0, nil
	}
	if len(name) > 128 {
		return "", 0, fmt.Errorf("%s=%q: longer than 128 characters", binding.AnnotationShimGroup, name)
	}
	grace = DefaultGroupGrace
	if v, ok := ann[binding.AnnotationShimGroupGrace]; ok {
		if grace, err = time.ParseDuration(v); err != nil || grace < 0 || grace > time.Hour {
			return "", 0, fmt.Errorf("%s=%q: want a duration between 0s and 1h", binding.AnnotationShimGroupGrace, v)
		}
	}
	return name, grace, nil
}

// groupStatePath is the state file of a group: one per containerd, namespace and
// group, named by a hash (the group name is never a path).
func groupStatePath(socketDir, containerd, ns, group string) string {
	sum := sha256.Sum256([]byte(containerd + "\x00" + ns + "\x00" + group))
	return filepath.Join(socketDir, groupDirName, hex.EncodeToString(sum[:16])+".json")
}

// lockedGroup is a group's state file, held under an exclusive flock.
type lockedGroup struct {
	f     *os.File
	path  string
	state groupState
}

// lockGroup opens and locks a group's state file. A shim that leaves removes the file
// under the lock; whoever waited on the removed file retries on the path's new one.
func lockGroup(path string) (*lockedGroup, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("shim group state: %w", err)
	}
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return nil, fmt.Errorf("shim group state: %w", err)
		}
		if err := flock(f); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock shim group state %s: %w", path, err)
		}
		var held, now unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Stat(path, &now) == nil && held.Ino == now.Ino && held.Dev == now.Dev {
			g := &lockedGroup{f: f, path: path}
			if err := json.NewDecoder(f).Decode(&g.state); err != nil && !errors.Is(err, io.EOF) {
				// A torn or foreign file: start the group afresh rather than fail.
				log.L.WithError(err).WithField("state", path).Warn("unreadable shim group state; starting the group afresh")
				g.state = groupState{}
			}
			return g, nil
		}
		f.Close()
	}
}

func flock(f *os.File) error {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// save rewrites the state, dropping pending starts that can no longer arrive.
func (g *lockedGroup) save() error {
	now := time.Now()
	for id, p := range g.state.Pending {
		if !p.live(now) {
			delete(g.state.Pending, id)
		}
	}
	b, err := json.Marshal(g.state)
	if err != nil {
		return err
	}
	if err := g.f.Truncate(0); err != nil {
		return err
	}
	if _, err := g.f.WriteAt(b, 0); err != nil {
		return fmt.Errorf("write shim group state: %w", err)
	}
	return nil
}

// settle, before unlocking, removes the state of a group with no shim and no start
// on its way (whoever leaves last cleans up, recorded or not), else saves it if changed.
func (g *lockedGroup) settle(changed bool) error {
	now := time.Now()
	for id, p := range g.state.Pending {
		if !p.live(now) {
			delete(g.state.Pending, id)
			changed = true
		}
	}
	if g.state.Address == "" && len(g.state.Pending) == 0 {
		if err := os.Remove(g.path); err != nil && !os.IsNotExist(err) {
			return err
		}
		return nil
	}
	if changed {
		return g.save()
	}
	return nil
}

// unlock releases the lock (closing the file drops the flock).
func (g *lockedGroup) unlock() { g.f.Close() }

func (g *lockedGroup) pending(id string, p pendingStart) {
	if g.state.Pending == nil {
		g.state.Pending = map[string]pendingStart{}
	}
	g.state.Pending[id] = p
}

// startGrouped is Start for a grouped container: join the group's live shim, or
// start one with containerd's runc manager and record it as the group's.
func (m *Manager) startGrouped(ctx context.Context, params *bootapi.BootstrapParams, group string, grace time.Duration) (*bootapi.BootstrapResult, error) {
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	socketDir := params.GetSocketDir()
	if socketDir == "" {
		socketDir = filepath.Join(defaults.DefaultStateDir, "s")
	}
	bundle, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	rec := groupRecord{Group: group, State: groupStatePath(socketDir, params.GetContainerdGrpcAddress(), ns, group), Grace: grace}
	b, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(groupRecordFile, b, 0o600); err != nil {
		return nil, fmt.Errorf("record shim group: %w", err)
	}
	g, err := lockGroup(rec.State)
	if err != nil {
		return nil, err
	}
	defer g.unlock()
	id := params.GetInstanceID()
	if addr := g.state.Address; addr != "" && reachable(addr) {
		g.pending(id, pendingStart{Address: addr, Bundle: bundle, At: time.Now()})
		if err := g.save(); err != nil {
			return nil, err
		}
		log.G(ctx).WithFields(log.Fields{"group": group, "address": addr}).Debug("joining the group's shim")
		return &bootapi.BootstrapResult{Version: 3, Protocol: "ttrpc", Address: addr}, nil
	}
	res, err := m.runc.Start(ctx, params)
	if err != nil {
		return nil, err
	}
	g.state.Address = res.GetAddress()
	g.pending(id, pendingStart{Address: res.GetAddress(), Bundle: bundle, At: time.Now()})
	if err := g.save(); err != nil {
		// The shim serves this container alone; nobody joins it.
		log.G(ctx).WithError(err).WithField("group", group).Warn("cannot record the group's new shim")
	}
	return res, nil
}

// reachable says whether a shim listens at addr. containerd's CanConnect gives up after
// 100 ms, which a loaded host's scheduler alone can exceed, starting a needless shim;
// a shim that is gone refuses at once, so a longer wait costs only a live, slow one.
func reachable(addr string) bool {
	conn, err := shim.AnonDialer(addr, 3*time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// shimGroup is what a grouped shim knows of its group.
type shimGroup struct {
	rec  groupRecord
	self string // this shim's own address
}

// selfAddress is the address this shim listens on: the socket containerd's runc
// manager created and handed down as fd 3 (what pkg/shim serves).
func selfAddress() string {
	sa, err := unix.Getsockname(3)
	if err != nil {
		return ""
	}
	if u, ok := sa.(*unix.SockaddrUnix); ok && u.Name != "" {
		return "unix://" + u.Name
	}
	return ""
}

// joinGroup, at Create of a grouped container, learns the group from the bundle and
// clears the container's pending start (it has arrived).
func (s *TaskService) joinGroup(ctx context.Context, id, bundle string) error {
	b, err := os.ReadFile(filepath.Join(bundle, groupRecordFile))
	if err != nil {
		return fmt.Errorf("shim group record: %w", err)
	}
	var rec groupRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return fmt.Errorf("shim group record: %w", err)
	}
	s.mu.Lock()
	if s.group == nil {
		s.group = &shimGroup{rec: rec, self: s.self}
		if s.self == "" {
			log.G(ctx).WithField("group", rec.Group).Warn("this shim does not know its own address; it will leave its group conservatively")
		}
	}
	g := s.group
	s.mu.Unlock()
	if rec.State != g.rec.State {
		// Only Start sends containers here, and only those of the shim's group.
		log.G(ctx).WithFields(log.Fields{"group": rec.Group, "serving": g.rec.Group}).Warn("container of another shim group")
		return nil
	}
	lg, err := lockGroup(g.rec.State)
	if err != nil {
		return err
	}
	defer lg.unlock()
	if _, ok := lg.state.Pending[id]; ok {
		delete(lg.state.Pending, id)
		return lg.save()
	}
	return nil
}

// liveLocked counts the containers this shim answers for, creates in flight included.
func (s *TaskService) liveLocked() int {
	return len(s.bundles) + len(s.adopted) + s.inflight
}

// idle arms the keep-alive of a grouped shim that serves nothing: after the grace
// (and at least floor), leaveGroup decides. containerd asks a shim to shut down right
// after each delete; the delete itself arms it with a floor, so that its answer is
// sent before the shim can go.
func (s *TaskService) idle(floor time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.group == nil || s.exiting || s.liveLocked() > 0 {
		return
	}
	d := max(s.group.rec.Grace, floor)
	if s.idleTimer == nil {
		s.idleTimer = time.AfterFunc(d, s.leaveGroup)
		return
	}
	s.idleTimer.Reset(d)
}

// leaveGroup shuts the shim down if, under the group's lock, it still serves nothing
// and no start was promised it; the record goes first, so later starts make a new shim.
func (s *TaskService) leaveGroup() {
	s.mu.Lock()
	g := s.group
	s.mu.Unlock()
	ctx := log.WithLogger(context.Background(), log.L.WithField("group", g.rec.Group))
	lg, err := lockGroup(g.rec.State)
	if err != nil {
		log.G(ctx).WithError(err).Error("cannot lock the group; staying up")
		s.idle(time.Second)
		return
	}
	defer lg.unlock()
	s.mu.Lock()
	if s.exiting || s.liveLocked() > 0 {
		s.mu.Unlock()
		return // a later delete re-arms the keep-alive
	}
	now := time.Now()
	for _, p := range lg.state.Pending {
		if (g.self == "" || p.Address == g.self) && p.live(now) {
			s.mu.Unlock()
			log.G(ctx).Debug("a start is on its way; staying up")
			go s.idle(100 * time.Millisecond)
			return
		}
	}
	// Not knowing its own address, a shim clears whatever is recorded: the worst
	// that does is start a fresh shim for the next member.
	changed := g.self == "" || lg.state.Address == g.self
	if changed {
		lg.state.Address = ""
	}
	if err := lg.settle(changed); err != nil && !changed {
		log.G(ctx).WithError(err).Warn("cannot remove the group's empty state")
	} else if err != nil {
		// Still recorded: a start could be handed this address, so stay.
		s.mu.Unlock()
		log.G(ctx).WithError(err).Error("cannot clear the group's record; staying up")
		go s.idle(time.Second)
		return
	}
	s.exiting = true
	s.mu.Unlock()
	// Nobody will dial this socket again; its file would otherwise stay behind.
	if path, ok := strings.CutPrefix(g.self, "unix://"); ok {
		os.Remove(path)
	}
	log.G(ctx).Info("group empty past its grace; shim exiting")
	if _, err := s.TTRPCTaskService.Shutdown(ctx, &taskapi.ShutdownRequest{}); err != nil {
		log.G(ctx).WithError(err).Warn("shutdown")
	}
}

// GroupStatePath is where a group's state lives, given containerd's shim socket
// directory (/run/containerd/s for root by default): tests check that a group leaves
// nothing behind.
func GroupStatePath(socketDir, containerdAddress, namespace, group string) string {
	return groupStatePath(socketDir, containerdAddress, namespace, group)
}

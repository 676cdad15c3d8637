package harness

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
)

// Process is a process found on the host.
type Process struct {
	Pid     int
	Cmdline []string
}

func (p Process) String() string {
	return fmt.Sprintf("%d (%s)", p.Pid, strings.Join(p.Cmdline, " "))
}

// procInfo is what the process scans look at.
type procInfo struct {
	Process
	env map[string]string
	cwd string
}

// scanProcesses returns the processes (other than this one) match accepts.
// Processes that exit during the scan are skipped.
func scanProcesses(match func(procInfo) bool) ([]Process, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	self := os.Getpid()
	var out []Process
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		dir := filepath.Join("/proc", e.Name())
		cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
		if err != nil || len(cmdline) == 0 { // gone, or a kernel thread
			continue
		}
		info := procInfo{Process: Process{Pid: pid, Cmdline: strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")}}
		if environ, err := os.ReadFile(filepath.Join(dir, "environ")); err == nil {
			info.env = map[string]string{}
			for _, kv := range strings.Split(string(environ), "\x00") {
				if k, v, ok := strings.Cut(kv, "="); ok {
					info.env[k] = v
				}
			}
		}
		info.cwd, _ = os.Readlink(filepath.Join(dir, "cwd"))
		if match(info) && processAlive(pid) {
			out = append(out, info.Process)
		}
	}
	return out, nil
}

// isShimOf says whether a process is a shim containerd (at address) started:
// containerd passes `-address <grpc socket>` and GRPC_ADDRESS to every shim,
// and a shim survives the containerd that started it.
func isShimOf(p procInfo, address string) bool {
	if address == "" {
		return false
	}
	if p.env["GRPC_ADDRESS"] == address {
		return true
	}
	for i := 0; i+1 < len(p.Cmdline); i++ {
		if p.Cmdline[i] == "-address" && p.Cmdline[i+1] == address {
			return true
		}
	}
	return false
}

// ShimProcesses lists the live shim processes of the containerd serving
// address, including shims whose containerd has stopped.
func ShimProcesses(address string) ([]Process, error) {
	return scanProcesses(func(p procInfo) bool { return isShimOf(p, address) })
}

// instanceProcesses lists every process tied to an instance: its shims, its
// containerd (whose config is under Dir), ctr processes talking to it, and
// anything working in its directory.
func instanceProcesses(rec instanceRecord) ([]Process, error) {
	if err := rec.validate(); err != nil {
		return nil, err
	}
	under := func(path string) bool { return path == rec.Dir || strings.HasPrefix(path, rec.Dir+"/") }
	return scanProcesses(func(p procInfo) bool {
		if isShimOf(p, rec.Address) || under(p.cwd) {
			return true
		}
		if rec.TTRPCAddress != "" && p.env["TTRPC_ADDRESS"] == rec.TTRPCAddress {
			return true
		}
		for _, arg := range p.Cmdline {
			if under(arg) {
				return true
			}
		}
		return false
	})
}

// MountsUnder lists the mount points at or below dir in this mount
// namespace, deepest first.
func MountsUnder(dir string) ([]string, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	var out []string
	for _, m := range mounts {
		out = append(out, m.Mountpoint)
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

// CgroupDirs returns the directories of cgroup rel (a path from the hierarchy
// root, as in an OCI cgroupsPath) in every mounted cgroup hierarchy (v1
// controllers, named hierarchies and the v2 unified one) where it exists.
func CgroupDirs(rel string) ([]string, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	rel = filepath.Clean("/" + rel)
	if rel == "/" {
		return nil, fmt.Errorf("refusing the root cgroup")
	}
	var out []string
	seen := map[string]bool{}
	for _, m := range mounts {
		// A hierarchy mounted from a sub-cgroup (m.Root) shows only that part.
		sub := rel
		if m.Root != "/" {
			if !strings.HasPrefix(rel, m.Root+"/") {
				continue
			}
			sub = strings.TrimPrefix(rel, m.Root)
		}
		d := filepath.Join(m.Mountpoint, sub)
		if seen[d] {
			continue
		}
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			seen[d] = true
			out = append(out, d)
		}
	}
	return out, nil
}

// CgroupsUnder lists the cgroup directories strictly below rel in every
// hierarchy: for rel "/<namespace>", the cgroups of that namespace's
// containers.
func CgroupsUnder(rel string) ([]string, error) {
	tops, err := CgroupDirs(rel)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, top := range tops {
		entries, err := os.ReadDir(top)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if e.IsDir() {
				out = append(out, filepath.Join(top, e.Name()))
			}
		}
	}
	return out, nil
}

// Leaks is what a scenario left behind in an instance.
type Leaks struct {
	Mounts    []string  // mounts under Root or State
	Shims     []Process // live shim processes
	Cgroups   []string  // container cgroups of the namespace and below tracked cgroups
	RuncState []string  // runc container state dirs of the instance
	Bundles   []string  // task bundles containerd still keeps
}

// Empty reports whether nothing leaked.
func (l Leaks) Empty() bool {
	return len(l.Mounts)+len(l.Shims)+len(l.Cgroups)+len(l.RuncState)+len(l.Bundles) == 0
}

func (l Leaks) String() string {
	var b strings.Builder
	list := func(name string, items []string) {
		if len(items) > 0 {
			fmt.Fprintf(&b, "%s:\n  %s\n", name, strings.Join(items, "\n  "))
		}
	}
	var shims []string
	for _, p := range l.Shims {
		shims = append(shims, p.String())
	}
	list("mounts", l.Mounts)
	list("shim processes", shims)
	list("cgroups", l.Cgroups)
	list("runc state", l.RuncState)
	list("task bundles", l.Bundles)
	return b.String()
}

// Leaks lists what is left of the containers this instance ran: mounts under
// its root and state, shims, cgroups below /<Namespace> and below each tracked
// cgroup (a tracked cgroup is a parent, like a pod's cgroup_parent), runc state
// and task bundles. With every container deleted, all are empty.
func (c *Containerd) Leaks() (Leaks, error) {
	var l Leaks
	for _, d := range []string{c.Root, c.State} {
		m, err := MountsUnder(d)
		if err != nil {
			return l, err
		}
		l.Mounts = append(l.Mounts, m...)
	}
	var err error
	if l.Shims, err = ShimProcesses(c.Address); err != nil {
		return l, err
	}
	c.mu.Lock()
	parents := append([]string{"/" + c.Namespace}, c.record.Cgroups...)
	c.mu.Unlock()
	for _, rel := range parents {
		cgs, err := CgroupsUnder(rel)
		if err != nil {
			return l, err
		}
		l.Cgroups = append(l.Cgroups, cgs...)
	}
	roots, _ := filepath.Glob(filepath.Join(c.RuncRoot, "*"))
	for _, root := range append(roots, filepath.Join(defaultRuncRoot, c.Namespace)) {
		for _, id := range runcContainers(root) {
			l.RuncState = append(l.RuncState, filepath.Join(root, id))
		}
	}
	for _, b := range listBundles(c.State) {
		l.Bundles = append(l.Bundles, filepath.Join(taskDir(c.State), b.namespace, b.id))
	}
	return l, nil
}

// LeakCheck fails the test unless, within 10 seconds (shims exit and clean
// up asynchronously after their last task is deleted), nothing of the
// instance's containers is left: see Leaks.
func (c *Containerd) LeakCheck(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l, err := c.Leaks()
		if err != nil {
			t.Fatalf("leak check: %v", err)
		}
		if l.Empty() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("leak check: left behind after the scenario:\n%s", l)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TaskParents is the set of parent pids (the shims) of the tasks that `ctr tasks
// ls` printed, only of the containers ids if any are given: with grouped shims a
// shim lives on while it parents a task, whatever container it was started for.
func TaskParents(tasksLs string, ids ...string) map[int]bool {
	parents := map[int]bool{}
	for _, line := range strings.Split(tasksLs, "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 2 || (len(ids) > 0 && !slices.Contains(ids, f[0])) {
			continue
		}
		status, err := os.ReadFile("/proc/" + f[1] + "/status")
		if err != nil {
			continue // gone: nothing parents it
		}
		for _, l := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(l, "PPid:"); ok {
				if ppid, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
					parents[ppid] = true
				}
			}
		}
	}
	return parents
}

// Zombies lists the children of parent that have exited and not been reaped.
func Zombies(parent int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so cut at its last ')'.
		i := strings.LastIndexByte(string(stat), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(stat[i+1:]))
		if len(f) < 2 || f[0] != "Z" {
			continue
		}
		if ppid, _ := strconv.Atoi(f[1]); ppid == parent {
			out = append(out, pid)
		}
	}
	return out
}

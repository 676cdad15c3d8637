package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// instanceRecord is what a cleanup needs to know about an instance; it is
// saved as <dir>/instance.json so a later test run can clean up after a test
// binary that died before its cleanups ran.
type instanceRecord struct {
	Dir          string   `json:"dir"`
	Address      string   `json:"address"`
	TTRPCAddress string   `json:"ttrpc_address"`
	Namespace    string   `json:"namespace"`
	Cgroups      []string `json:"cgroups,omitempty"`
}

// validate refuses a record that could make a cleanup reach beyond its
// instance: every field that selects processes, cgroups or directories must
// name this instance (an empty address would match every process).
func (r instanceRecord) validate() error {
	base := filepath.Base(r.Dir)
	switch {
	case !filepath.IsAbs(r.Dir) || filepath.Clean(r.Dir) != r.Dir || !strings.HasPrefix(base, instancePrefix) || len(base) <= len(instancePrefix):
		return fmt.Errorf("instance record: %q is not an instance directory", r.Dir)
	case r.Namespace != base:
		return fmt.Errorf("instance record: namespace %q is not the directory's name %q", r.Namespace, base)
	case r.Address == "" || !strings.HasPrefix(r.Address, r.Dir+"/"):
		return fmt.Errorf("instance record: address %q is not under %s", r.Address, r.Dir)
	case r.TTRPCAddress != "" && !strings.HasPrefix(r.TTRPCAddress, r.Dir+"/"):
		return fmt.Errorf("instance record: ttrpc address %q is not under %s", r.TTRPCAddress, r.Dir)
	}
	for _, cg := range r.Cgroups {
		if c := filepath.Clean("/" + cg); c == "/" {
			return fmt.Errorf("instance record: refusing cgroup %q", cg)
		}
	}
	return nil
}

// defaultRuncRoot is the runc shim's root when its options give none; the
// runc state of namespace ns lives in <root>/<ns>/<container id>.
const defaultRuncRoot = "/run/containerd/runc"

// taskDir is where containerd keeps the bundles of a state dir: <ns>/<id>.
func taskDir(state string) string { return filepath.Join(state, "io.containerd.runtime.v2.task") }

var sweepOnce sync.Once

// sweepStale cleans the instances under base whose owner is gone. An owner
// holds an flock on <dir>/.lock for as long as it lives; the kernel drops it
// when the process dies however it dies, so a lock we can take marks an
// abandoned instance (and taking it keeps a concurrent sweeper away).
func sweepStale(base string) []string {
	records, _ := filepath.Glob(filepath.Join(base, instancePrefix+"*", "instance.json"))
	var msgs []string
	for _, path := range records {
		dir := filepath.Dir(path)
		lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_RDWR, 0)
		if err != nil {
			continue
		}
		if unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
			lock.Close() // alive
			continue
		}
		var rec instanceRecord
		data, err := os.ReadFile(path)
		if err == nil {
			err = json.Unmarshal(data, &rec)
		}
		if err == nil {
			err = rec.validate()
		}
		if err != nil || rec.Dir != dir {
			msgs = append(msgs, fmt.Sprintf("abandoned instance %s has no usable record (%v); left alone", dir, err))
			lock.Close()
			continue
		}
		msgs = append(msgs, fmt.Sprintf("cleaning abandoned instance %s", dir))
		for _, err := range cleanupInstance(rec) {
			msgs = append(msgs, err.Error())
		}
		lock.Close()
	}
	return msgs
}

// cleanupInstance removes everything an instance may have left: its processes
// (containerd, shims, ctr), its containers and their runc state, their cgroups,
// the mounts under its directory, and the directory. containerd should be
// stopped first; whatever still runs is killed. Errors are what remains.
func cleanupInstance(rec instanceRecord) []error {
	if err := rec.validate(); err != nil {
		return []error{err}
	}
	var errs []error
	fail := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}

	// 1. Shims first: a live shim would react to its container dying below.
	fail(killProcesses(instanceProcesses(rec)))

	// 2. Containers: `runc delete --force` kills them and removes their runc
	// state and cgroups. The bundles say which runc root and binary each used.
	bundles := listBundles(filepath.Join(rec.Dir, "state"))
	targets := map[[2]string]string{} // {root, id} -> runtime binary
	for _, b := range bundles {
		targets[[2]string{filepath.Join(b.runcRoot, b.namespace), b.id}] = b.runtime
	}
	// Roots only this instance uses: every container in them is ours.
	exclusive := []string{filepath.Join(defaultRuncRoot, rec.Namespace)}
	nsRoots, _ := filepath.Glob(filepath.Join(rec.Dir, "runc", "*"))
	exclusive = append(exclusive, nsRoots...)
	for _, root := range exclusive {
		for _, id := range runcContainers(root) {
			if _, ok := targets[[2]string{root, id}]; !ok {
				targets[[2]string{root, id}] = ""
			}
		}
	}
	for key, runtime := range targets {
		fail(runcDelete(runtime, key[0], key[1]))
	}

	// 3. Cgroups: the namespace's parent (ctr puts containers in /<ns>/<id>),
	// each bundle's cgroupsPath, and what the test tracked.
	rels := append([]string{"/" + rec.Namespace}, rec.Cgroups...)
	for _, b := range bundles {
		if b.cgroupsPath != "" {
			rels = append(rels, b.cgroupsPath)
		}
	}
	for _, rel := range rels {
		dirs, err := CgroupDirs(rel)
		fail(err)
		for _, d := range dirs {
			fail(removeCgroup(d))
		}
	}

	// 4. Mounts (rootfs of tasks whose shim died, FUSE views, netns...),
	// deepest first, lazily so that a busy one cannot stop us.
	if err := mount.UnmountRecursive(rec.Dir, unix.MNT_DETACH); err != nil {
		fail(fmt.Errorf("unmount under %s: %w", rec.Dir, err))
	}
	if left, err := MountsUnder(rec.Dir); err != nil || len(left) > 0 {
		fail(fmt.Errorf("mounts left under %s: %v %v", rec.Dir, left, err))
	}

	// 5. Directories.
	for _, root := range exclusive {
		fail(removeAll(root))
	}
	fail(removeAll(rec.Dir))
	return errs
}

func removeAll(dir string) error {
	var err error
	for try := 0; try < 5; try++ {
		if err = os.RemoveAll(dir); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("remove %s: %w", dir, err)
}

// bundle is a task bundle containerd keeps in its state dir.
type bundle struct {
	namespace, id string
	runcRoot      string // the runc options Root, defaultRuncRoot if unset
	runtime       string // the OCI runtime binary the shim used ("" for runc)
	cgroupsPath   string // linux.cgroupsPath of config.json
}

func listBundles(state string) []bundle {
	dirs, _ := filepath.Glob(filepath.Join(taskDir(state), "*", "*"))
	var out []bundle
	for _, dir := range dirs {
		b := bundle{namespace: filepath.Base(filepath.Dir(dir)), id: filepath.Base(dir), runcRoot: defaultRuncRoot}
		if data, err := os.ReadFile(filepath.Join(dir, "options.json")); err == nil {
			var o struct {
				Root string `json:"root"`
			}
			if json.Unmarshal(data, &o) == nil && o.Root != "" {
				b.runcRoot = o.Root
			}
		}
		if data, err := os.ReadFile(filepath.Join(dir, "runtime")); err == nil {
			b.runtime = strings.TrimSpace(string(data))
		}
		if data, err := os.ReadFile(filepath.Join(dir, "config.json")); err == nil {
			var spec struct {
				Linux struct {
					CgroupsPath string `json:"cgroupsPath"`
				} `json:"linux"`
			}
			// systemd-style "slice:prefix:name" paths are not directories.
			if json.Unmarshal(data, &spec) == nil && !strings.Contains(spec.Linux.CgroupsPath, ":") {
				b.cgroupsPath = spec.Linux.CgroupsPath
			}
		}
		out = append(out, b)
	}
	return out
}

// runcContainers lists the container ids with state under a runc root.
func runcContainers(root string) []string {
	states, _ := filepath.Glob(filepath.Join(root, "*", "state.json"))
	var ids []string
	for _, s := range states {
		ids = append(ids, filepath.Base(filepath.Dir(s)))
	}
	return ids
}

// runcDelete force-deletes a container: kills its processes, removes its
// cgroups and state. A container already gone is not an error.
func runcDelete(runtime, root, id string) error {
	if _, err := os.Stat(filepath.Join(root, id)); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if runtime == "" {
		var err error
		if runtime, err = testenv.Tool("runc"); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, runtime, "--root", root, "delete", "--force", id).CombinedOutput()
	if err != nil {
		if _, serr := os.Stat(filepath.Join(root, id)); errors.Is(serr, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("%s --root %s delete --force %s: %w: %s", runtime, root, id, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// killProcesses SIGKILLs processes and waits (up to 10s) until they are gone.
func killProcesses(procs []Process, err error) error {
	if err != nil {
		return err
	}
	for _, p := range procs {
		_ = syscall.Kill(p.Pid, syscall.SIGKILL)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, p := range procs {
		for processAlive(p.Pid) {
			if time.Now().After(deadline) {
				return fmt.Errorf("process %s survived SIGKILL", p)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// processAlive reports whether pid exists and is not a zombie.
func processAlive(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// The state follows the parenthesised command name, which may contain spaces.
	i := strings.LastIndexByte(string(stat), ')')
	return i < 0 || i+2 >= len(stat) || (stat[i+2] != 'Z' && stat[i+2] != 'X')
}

// removeCgroup kills everything in a cgroup subtree and removes it, deepest
// first. Frozen cgroups are thawed first: a frozen process cannot act on
// SIGKILL, and the warm pools freeze tasks.
func removeCgroup(top string) error {
	var dirs []string
	err := filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("cgroup %s: %w", top, err)
	}
	if len(dirs) == 0 {
		return nil
	}
	for _, d := range dirs { // top-down
		_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte("THAWED"), 0)
		_ = os.WriteFile(filepath.Join(d, "cgroup.freeze"), []byte("0"), 0)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var alive []int
		for _, d := range dirs {
			alive = append(alive, cgroupProcs(d)...)
		}
		if len(alive) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s: processes %v survive SIGKILL", top, alive)
		}
		for _, pid := range alive {
			if pid > 1 && pid != os.Getpid() {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, d := range dirs {
		var err error
		for try := 0; try < 50; try++ {
			if err = unix.Rmdir(d); err == nil || errors.Is(err, unix.ENOENT) {
				err = nil
				break
			}
			time.Sleep(20 * time.Millisecond) // EBUSY while exiting tasks detach
		}
		if err != nil {
			return fmt.Errorf("remove cgroup %s: %w", d, err)
		}
	}
	return nil
}

// cgroupProcs lists the pids in one cgroup directory (not its children).
func cgroupProcs(dir string) []int {
	data, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

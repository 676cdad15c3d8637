package harness

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// ctr runs ctr against c and fails the test on error.
func ctr(t testing.TB, c *Containerd, args ...string) string {
	t.Helper()
	out, err := c.Ctr(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// runRm is `ctr run --rm` of image with FIFOs under the instance.
func runRm(t testing.TB, c *Containerd, image, id string, extra []string, cmd ...string) string {
	t.Helper()
	args := append([]string{"run", "--rm", "--fifo-dir", c.FIFODir}, extra...)
	return ctr(t, c, append(append(args, image, id), cmd...)...)
}

// taskPids maps running task ids to their pids (`ctr task ls`).
func taskPids(t testing.TB, c *Containerd) map[string]int {
	t.Helper()
	pids := map[string]int{}
	sc := bufio.NewScanner(strings.NewReader(ctr(t, c, "task", "ls")))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[0] != "TASK" {
			pid, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatalf("task ls line %q", sc.Text())
			}
			if f[2] == "RUNNING" || f[2] == "PAUSED" {
				pids[f[0]] = pid
			}
		}
	}
	return pids
}

// removeTask kills and deletes a task and its container.
func removeTask(t testing.TB, c *Containerd, id string) {
	t.Helper()
	ctr(t, c, "task", "rm", "--force", id)
	ctr(t, c, "container", "rm", id)
}

func TestRunBusybox(t *testing.T) {
	c := StartContainerd(t, Options{})
	c.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef)

	if out := runRm(t, c, imagebuild.BusyboxRef, "echo", nil, "echo", "hello from busybox"); out != "hello from busybox\n" {
		t.Fatalf("echo printed %q", out)
	}
	// The image's users, and the permissions the builder set, reach the container.
	out := runRm(t, c, imagebuild.BusyboxRef, "agent", []string{"--user", "1000:1000"}, "sh", "-c", "id; stat -c '%a %U' /tmp /workspace; touch /workspace/ok")
	want := "uid=1000(agent) gid=1000(agent) groups=1000(agent)\n1777 root\n755 agent\n"
	if out != want {
		t.Fatalf("as agent:\n%s\nwant:\n%s", out, want)
	}
	c.LeakCheck(t)

	// How long a whole `ctr run --rm` of /bin/true takes (reported, not asserted).
	var times []time.Duration
	for i := range 7 {
		start := time.Now()
		runRm(t, c, imagebuild.BusyboxRef, fmt.Sprintf("true-%d", i), nil, "true")
		times = append(times, time.Since(start))
	}
	slices.Sort(times)
	t.Logf("ctr run --rm busybox true: median %v, min %v, max %v over %d runs", times[len(times)/2], times[0], times[len(times)-1], len(times))
	c.LeakCheck(t)
}

func TestNodeImage(t *testing.T) {
	archive := imagebuild.NodeArchive(t) // before the instance: the first build runs npm
	c := StartContainerd(t, Options{})
	c.ImportImage(t, archive.Path, imagebuild.NodeRef)

	out := runRm(t, c, imagebuild.NodeRef, "lodash", nil, "node", "-e", "console.log(require('/app/node_modules/lodash').VERSION)")
	if out != imagebuild.NodePackages["lodash"]+"\n" {
		t.Fatalf("lodash version: %q", out)
	}
	// debug resolves its own nested ms@2.1.2, the app gets ms@2.1.3.
	out = runRm(t, c, imagebuild.NodeRef, "nested", nil, "node", "-e",
		"const m = require('module').createRequire('/app/node_modules/debug/src/index.js');"+
			"console.log(m('ms/package.json').version, require('/app/node_modules/ms/package.json').version)")
	if out != "2.1.2 2.1.3\n" {
		t.Fatalf("nested dependency versions: %q", out)
	}
	// The default command (/app/index.js, from /app as working directory), as agent.
	out = runRm(t, c, imagebuild.NodeRef, "default", []string{"--user", "1000:1000"})
	var got struct {
		Lodash string `json:"lodash"`
		MS     int    `json:"ms"`
		Debug  string `json:"debug"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || got.Lodash != "4.17.21" || got.MS != 7200000 || got.Debug != "function" {
		t.Fatalf("default command printed %q (%v)", out, err)
	}
	c.LeakCheck(t)
}

func TestRestartKeepsImagesAndTasks(t *testing.T) {
	c := StartContainerd(t, Options{})
	c.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef)
	ctr(t, c, "run", "-d", "--fifo-dir", c.FIFODir, imagebuild.BusyboxRef, "sleeper", "sleep", "1000")
	before := taskPids(t, c)["sleeper"]
	if before == 0 {
		t.Fatal("sleeper is not running")
	}

	for _, how := range []string{"stop", "kill"} {
		oldPid := c.Pid()
		if how == "kill" {
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Restart(); err != nil {
			t.Fatalf("restart after %s: %v", how, err)
		}
		if c.Pid() == 0 || c.Pid() == oldPid || processAlive(oldPid) {
			t.Fatalf("after %s: pid %d, old pid %d", how, c.Pid(), oldPid)
		}
		if images := ctr(t, c, "images", "ls", "-q"); !strings.Contains(images, imagebuild.BusyboxRef) {
			t.Fatalf("after %s the image is gone: %q", how, images)
		}
		if pid := taskPids(t, c)["sleeper"]; pid != before {
			t.Fatalf("after %s the task has pid %d, want %d still running", how, pid, before)
		}
	}
	if out := runRm(t, c, imagebuild.BusyboxRef, "after", nil, "echo", "ok"); out != "ok\n" {
		t.Fatalf("run after restarts printed %q", out)
	}
	removeTask(t, c, "sleeper")
	c.LeakCheck(t)
}

func TestTwoInstancesDoNotCollide(t *testing.T) {
	busybox := imagebuild.BusyboxArchive(t).Path
	a := StartContainerd(t, Options{})
	b := StartContainerd(t, Options{})
	if a.Namespace == b.Namespace || a.Dir == b.Dir {
		t.Fatalf("instances share %s / %s", a.Namespace, a.Dir)
	}
	for _, c := range []*Containerd{a, b} {
		c.ImportImage(t, busybox, imagebuild.BusyboxRef)
		// The same container id in both.
		ctr(t, c, "run", "-d", "--fifo-dir", c.FIFODir, imagebuild.BusyboxRef, "same", "sleep", "1000")
	}
	pa, pb := taskPids(t, a)["same"], taskPids(t, b)["same"]
	if pa == 0 || pb == 0 || pa == pb {
		t.Fatalf("task pids %d and %d", pa, pb)
	}
	shimsA, err := ShimProcesses(a.Address)
	if err != nil {
		t.Fatal(err)
	}
	shimsB, err := ShimProcesses(b.Address)
	if err != nil {
		t.Fatal(err)
	}
	if len(shimsA) != 1 || len(shimsB) != 1 || shimsA[0].Pid == shimsB[0].Pid {
		t.Fatalf("shims: %v and %v", shimsA, shimsB)
	}
	// Each container has its own cgroups and runc state.
	for _, c := range []*Containerd{a, b} {
		cgs, err := CgroupDirs("/" + c.Namespace + "/same")
		if err != nil || len(cgs) == 0 {
			t.Fatalf("%s: cgroups %v %v", c.Namespace, cgs, err)
		}
		if _, err := os.Stat(filepath.Join(defaultRuncRoot, c.Namespace, "same", "state.json")); err != nil {
			t.Fatalf("%s: runc state: %v", c.Namespace, err)
		}
	}
	// Removing one leaves the other running.
	removeTask(t, a, "same")
	a.LeakCheck(t)
	if pid := taskPids(t, b)["same"]; pid != pb {
		t.Fatalf("b's task: pid %d, want %d", pid, pb)
	}
	removeTask(t, b, "same")
	b.LeakCheck(t)
}

// residue is what a cleanup must have removed, checked from outside.
type residue struct {
	dir, address, namespace string
	pids                    []int // containerd, shims, container processes
}

func (r residue) check(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(r.dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("instance dir %s still exists (%v)", r.dir, err)
	}
	if m, err := MountsUnder(r.dir); err != nil || len(m) > 0 {
		t.Errorf("mounts left: %v %v", m, err)
	}
	if s, err := ShimProcesses(r.address); err != nil || len(s) > 0 {
		t.Errorf("shims left: %v %v", s, err)
	}
	for _, pid := range r.pids {
		if processAlive(pid) {
			t.Errorf("process %d still runs", pid)
		}
	}
	if cgs, err := CgroupDirs("/" + r.namespace); err != nil || len(cgs) > 0 {
		t.Errorf("cgroups left: %v %v", cgs, err)
	}
	if _, err := os.Stat(filepath.Join(defaultRuncRoot, r.namespace)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("runc state of %s left (%v)", r.namespace, err)
	}
}

// leaveMess starts containers and leaves them for the cleanup: one running,
// one frozen (a frozen process ignores SIGKILL until thawed), one created and
// never started.
func leaveMess(t *testing.T, c *Containerd) residue {
	t.Helper()
	c.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef)
	for _, id := range []string{"running", "frozen"} {
		ctr(t, c, "run", "-d", "--fifo-dir", c.FIFODir, imagebuild.BusyboxRef, id, "sleep", "1000")
	}
	ctr(t, c, "task", "pause", "frozen")
	ctr(t, c, "container", "create", imagebuild.BusyboxRef, "created", "sleep", "1000")
	ctr(t, c, "task", "start", "-d", "--fifo-dir", c.FIFODir, "created")
	r := residue{dir: c.Dir, address: c.Address, namespace: c.Namespace, pids: []int{c.Pid()}} // containerd first
	for _, pid := range taskPids(t, c) {
		r.pids = append(r.pids, pid)
	}
	shims, err := ShimProcesses(c.Address)
	if err != nil || len(shims) == 0 {
		t.Fatalf("no shims found: %v", err)
	}
	for _, s := range shims {
		r.pids = append(r.pids, s.Pid)
	}
	if len(r.pids) < 1+3+1 {
		t.Fatalf("expected containerd, 3 tasks and shims, got pids %v", r.pids)
	}
	return r
}

func TestCleanupLeavesNothing(t *testing.T) {
	for _, crash := range []bool{false, true} {
		name := "containerd running"
		if crash {
			name = "containerd crashed"
		}
		var r residue
		t.Run(name, func(t *testing.T) {
			c := StartContainerd(t, Options{})
			r = leaveMess(t, c)
			if crash {
				if err := c.Kill(); err != nil {
					t.Fatal(err)
				}
			}
		}) // the subtest's cleanup has run here
		r.check(t)
	}
}

// TestAbandonedInstanceHelper is run as a child process by
// TestAbandonedInstanceIsSwept: it leaves containers running and exits
// without running its cleanups, like a test binary killed by a timeout.
func TestAbandonedInstanceHelper(t *testing.T) {
	if os.Getenv("HARNESS_ABANDON") != "1" {
		t.Skip("helper process for TestAbandonedInstanceIsSwept")
	}
	c := StartContainerd(t, Options{})
	r := leaveMess(t, c)
	out, _ := json.Marshal(map[string]any{"dir": r.dir, "address": r.address, "namespace": r.namespace, "pids": r.pids})
	fmt.Printf("ABANDONED %s\n", out)
	os.Exit(0)
}

func TestAbandonedInstanceIsSwept(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestAbandonedInstanceHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), "HARNESS_ABANDON=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v\n%s", err, out)
	}
	var r residue
	for _, line := range strings.Split(string(out), "\n") {
		if data, ok := strings.CutPrefix(line, "ABANDONED "); ok {
			var v struct {
				Dir, Address, Namespace string
				Pids                    []int
			}
			if err := json.Unmarshal([]byte(data), &v); err != nil {
				t.Fatal(err)
			}
			r = residue{dir: v.Dir, address: v.Address, namespace: v.Namespace, pids: v.Pids}
		}
	}
	if r.dir == "" {
		t.Fatalf("helper printed no instance:\n%s", out)
	}
	// Safety net should the sweep fail: the normal cleanup of a record.
	t.Cleanup(func() {
		cleanupInstance(instanceRecord{Dir: r.dir, Address: r.address, TTRPCAddress: r.dir + "/c.ttrpc", Namespace: r.namespace})
	})
	if _, err := os.Stat(r.dir); err != nil {
		t.Fatalf("the helper's instance is already gone: %v", err)
	}
	// containerd died with the helper (PR_SET_PDEATHSIG), before any sweep.
	containerd := r.pids[0]
	for deadline := time.Now().Add(5 * time.Second); processAlive(containerd); {
		if time.Now().After(deadline) {
			t.Fatalf("containerd %d outlived its test binary", containerd)
		}
		time.Sleep(10 * time.Millisecond)
	}
	shims, _ := ShimProcesses(r.address)
	if len(shims) == 0 {
		t.Fatal("the abandoned instance has no shims left to sweep: the test proves nothing")
	}
	msgs := sweepStale(instanceBase())
	t.Logf("sweep: %v", msgs)
	r.check(t)
}

func TestDaemon(t *testing.T) {
	sh, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("skipping: needs busybox (busybox-static)")
	}
	dir := t.TempDir()
	marker := filepath.Join(dir, "ready")
	fileReady := func(context.Context) error {
		_, err := os.Stat(marker)
		return err
	}

	t.Run("stops on SIGTERM and restarts", func(t *testing.T) {
		d := StartDaemon(t, DaemonSpec{Path: sh, Args: []string{"sh", "-c", "echo started; touch " + marker + "; exec sleep 1000"}, Ready: fileReady})
		first := d.Pid()
		if err := d.Stop(); err != nil {
			t.Fatalf("stop: %v", err)
		}
		if d.Running() || processAlive(first) {
			t.Fatal("still running after Stop")
		}
		os.Remove(marker)
		if err := d.Restart(context.Background()); err != nil {
			t.Fatal(err)
		}
		if d.Pid() == 0 || d.Pid() == first {
			t.Fatalf("restart: pid %d (was %d)", d.Pid(), first)
		}
		if n := strings.Count(tailFile(d.LogPath(), 100)+"\n", "\nstarted\n"); n != 2 {
			t.Fatalf("log has %d starts, want both runs appended", n)
		}
	})

	t.Run("SIGKILL after the stop timeout, group cleaned", func(t *testing.T) {
		os.Remove(marker)
		pidFile := filepath.Join(dir, "child")
		d := NewDaemon(DaemonSpec{
			Path: sh,
			// Ignores SIGTERM and leaves a child in its process group.
			Args:        []string{"sh", "-c", "trap '' TERM; sleep 1000 & echo $! > " + pidFile + "; touch " + marker + "; while :; do sleep 1; done"},
			LogPath:     filepath.Join(dir, "stubborn.log"),
			Ready:       fileReady,
			StopTimeout: 300 * time.Millisecond,
		})
		if err := d.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		data, err := os.ReadFile(pidFile)
		if err != nil {
			t.Fatal(err)
		}
		child, _ := strconv.Atoi(strings.TrimSpace(string(data)))
		if err := d.Stop(); err == nil || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("Stop of a daemon ignoring SIGTERM: %v", err)
		}
		if !processAlive(child) {
			t.Fatal("the child died with the leader: the group test proves nothing")
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for processAlive(child) && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if processAlive(child) {
			t.Fatalf("child %d of the daemon's group survived Close", child)
		}
	})

	t.Run("exit before ready is reported with the log", func(t *testing.T) {
		d := NewDaemon(DaemonSpec{
			Path: sh, Args: []string{"sh", "-c", "echo cannot bind socket >&2; exit 3"},
			LogPath: filepath.Join(dir, "failing.log"),
			Ready:   func(context.Context) error { return errors.New("no socket") },
		})
		err := d.Start(context.Background())
		if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "cannot bind socket") {
			t.Fatalf("Start: %v", err)
		}
	})

	t.Run("notify: ready once READY=1 arrives", func(t *testing.T) {
		notified := filepath.Join(dir, "notified")
		d := NewDaemon(DaemonSpec{
			Path: os.Args[0], Args: []string{"-test.run", "^TestNotifyHelper$", "-test.count=1"},
			Env:     append(os.Environ(), "HARNESS_NOTIFY="+notified),
			LogPath: filepath.Join(dir, "notify.log"),
			Notify:  true,
		})
		if err := d.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		if _, err := os.Stat(notified); err != nil {
			t.Fatalf("Start returned before the daemon notified READY=1: %v", err)
		}
	})

	// A daemon that never gets ready (no READY=1, or Ready never succeeds) fails its
	// start, and is killed.
	for _, c := range []struct {
		name, want string
		spec       DaemonSpec
	}{
		{"notify: no READY=1 is a start failure", "READY=1", DaemonSpec{Notify: true, ReadyTimeout: 300 * time.Millisecond}},
		{"ready timeout kills it", "not ready", DaemonSpec{
			Ready: func(context.Context) error { return errors.New("not yet") }, ReadyTimeout: 200 * time.Millisecond}},
	} {
		t.Run(c.name, func(t *testing.T) {
			spec := c.spec
			spec.Path, spec.Args, spec.LogPath = sh, []string{"sleep", "1000"}, filepath.Join(dir, "never-ready.log")
			d := NewDaemon(spec)
			err := d.Start(context.Background())
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Start: %v", err)
			}
			if d.Running() {
				t.Fatal("a daemon that never got ready is still running")
			}
		})
	}
}

func TestConfigOptions(t *testing.T) {
	c := StartContainerd(t, Options{
		ExtraTOML: `
[plugins.'io.containerd.gc.v1.scheduler']
  pause_threshold = 0.05
[plugins.'io.containerd.shim.v1.manager']
  env = ['FROM_EXTRA=1']
`,
		ProxyPlugins: map[string]ProxyPlugin{
			"tidepool": {Type: "snapshot", Address: "/run/tidepool-test-absent.sock", Exports: map[string]string{"root": "/x"}, Capabilities: []string{"rebase"}},
		},
		Env: []string{"TIDEPOOL_TEST_ENV=on"},
	})
	dump, err := exec.Command(mustTool(t, "containerd"), "--config", c.ConfigPath, "config", "dump").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"socket_dir = '" + filepath.Join(c.Dir, "s") + "'", // the harness's keys survive the merge
		"pause_threshold = 0.05",
		"env = ['FROM_EXTRA=1']",
		"[proxy_plugins.tidepool]",
		"capabilities = ['rebase']",
		"root = '/x'",
	} {
		if !strings.Contains(string(dump), want) {
			t.Errorf("config dump lacks %q", want)
		}
	}
	// The proxy snapshotter is registered (its socket is dialled lazily).
	if out := ctr(t, c, "plugins", "ls"); !regexpLine(out, "io.containerd.snapshotter.v1", "tidepool", "ok") {
		t.Errorf("proxy plugin not registered:\n%s", out)
	}
	environ, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(c.Pid()), "environ"))
	if err != nil {
		t.Fatal(err)
	}
	env := strings.Split(string(environ), "\x00")
	if !slices.Contains(env, "TIDEPOOL_TEST_ENV=on") {
		t.Errorf("Options.Env missing from containerd's environment")
	}
	for _, kv := range env {
		if p, ok := strings.CutPrefix(kv, "PATH="); ok && !strings.HasPrefix(p, testenv.ProjectBin()+":"+testenv.DepsBin()+":") {
			t.Errorf("PATH = %s, want the project and deps bins first", p)
		}
	}
}

func regexpLine(out string, fields ...string) bool {
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) >= 3 && f[0] == fields[0] && f[1] == fields[1] && f[len(f)-1] == fields[2] {
			return true
		}
	}
	return false
}

func mustTool(t testing.TB, name string) string {
	t.Helper()
	p, err := testenv.Tool(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestCRIRunsAPodWithThePinnedPauseImage(t *testing.T) {
	c := StartContainerd(t, Options{CRI: true})
	pods := "/" + c.Namespace + "-pods"
	if err := c.TrackCgroup(pods); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rt, img, err := c.CRI(ctx)
	if err != nil {
		t.Fatal(err)
	}
	st, err := img.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: imagebuild.PauseRef}})
	if err != nil || st.Image == nil || !st.Image.Pinned {
		t.Fatalf("pause image status: %+v %v", st, err)
	}
	cfg := &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "harness", Namespace: "default", Uid: c.Namespace, Attempt: 0},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent: pods,
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE},
			},
		},
	}
	run, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg})
	if err != nil {
		t.Fatalf("RunPodSandbox: %v", err)
	}
	status, err := rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: run.PodSandboxId})
	if err != nil || status.Status.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Fatalf("sandbox status: %+v %v", status, err)
	}
	// runc state goes to the instance's RuncRoot, not /run/containerd/runc/k8s.io.
	if _, err := os.Stat(filepath.Join(c.RuncRoot, CRINamespace, run.PodSandboxId, "state.json")); err != nil {
		t.Fatalf("pause container state not under %s: %v", c.RuncRoot, err)
	}
	if cgs, err := CgroupDirs(pods + "/" + run.PodSandboxId); err != nil || len(cgs) == 0 {
		t.Fatalf("pod cgroup: %v %v", cgs, err)
	}
	if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: run.PodSandboxId}); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: run.PodSandboxId}); err != nil {
		t.Fatalf("RemovePodSandbox: %v", err)
	}
	c.LeakCheck(t)
}

func TestRecordsThatCouldReachBeyondTheInstanceAreRefused(t *testing.T) {
	good := instanceRecord{Dir: "/tmp/tph-0", Address: "/tmp/tph-0/c.sock", TTRPCAddress: "/tmp/tph-0/c.ttrpc", Namespace: "tph-0"}
	if err := good.validate(); err != nil {
		t.Fatalf("valid record refused: %v", err)
	}
	for name, mutate := range map[string]func(*instanceRecord){
		"empty":           func(r *instanceRecord) { *r = instanceRecord{} },
		"empty address":   func(r *instanceRecord) { r.Address = "" },
		"foreign address": func(r *instanceRecord) { r.Address = "/run/containerd/containerd.sock" },
		"foreign ttrpc":   func(r *instanceRecord) { r.TTRPCAddress = "/run/containerd/containerd.sock.ttrpc" },
		"not an instance": func(r *instanceRecord) { r.Dir, r.Address, r.Namespace = "/tmp", "/tmp/c.sock", "tmp" },
		"bare prefix":     func(r *instanceRecord) { r.Dir, r.Address, r.Namespace = "/tmp/tph-", "/tmp/tph-/c.sock", "tph-" },
		"unclean dir":     func(r *instanceRecord) { r.Dir = "/tmp/../tmp/tph-0" },
		"other namespace": func(r *instanceRecord) { r.Namespace = "default" },
		"root cgroup":     func(r *instanceRecord) { r.Cgroups = []string{"/"} },
		"empty cgroup":    func(r *instanceRecord) { r.Cgroups = []string{""} },
	} {
		r := good
		mutate(&r)
		if err := r.validate(); err == nil {
			t.Errorf("%s: record %+v accepted", name, r)
		}
		if errs := cleanupInstance(r); len(errs) != 1 {
			t.Errorf("%s: cleanup of a refused record did something: %v", name, errs)
		}
		if procs, err := instanceProcesses(r); err == nil || len(procs) > 0 {
			t.Errorf("%s: instanceProcesses matched %v (%v)", name, procs, err)
		}
	}
	// A valid record of an instance that does not exist matches no process,
	// not even ones without a TTRPC_ADDRESS or a readable cwd.
	absent := instanceRecord{Dir: "/tmp/tph-absent", Address: "/tmp/tph-absent/c.sock", Namespace: "tph-absent"}
	if procs, err := instanceProcesses(absent); err != nil || len(procs) > 0 {
		t.Fatalf("processes of an absent instance: %v %v", procs, err)
	}
}

// TestNotifyHelper is the daemon of the notify subtest: it notifies STATUS, then (a
// while later, having written the file HARNESS_NOTIFY names) READY=1, as
// sd_notify(3) does, and stays up.
func TestNotifyHelper(t *testing.T) {
	marker := os.Getenv("HARNESS_NOTIFY")
	if marker == "" {
		t.Skip("run by the notify subtest")
	}
	if _, err := daemon.SdNotify(false, "STATUS=starting"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := os.WriteFile(marker, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if ok, err := daemon.SdNotify(false, "STATUS=up\n"+daemon.SdNotifyReady); !ok || err != nil {
		t.Fatalf("notify: %v, %v", ok, err)
	}
	time.Sleep(time.Hour)
}

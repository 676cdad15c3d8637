package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
)

// branchWorkdir is where parents and pool members see their fork. The Node image
// has nothing there, so a container's merged workdir is exactly its fork's tree.
const branchWorkdir = "/src"

// branchStack starts a stack with a Node pool whose members take forks at /src.
func branchStack(t testing.TB, target int) *stack.Stack {
	t.Helper()
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{TidepooldConfig: func(s *stack.Stack) string {
		return s.PoolConfig(stack.Pool{Name: "node", Image: imagebuild.NodeRef, Workdir: branchWorkdir, Target: target})
	}})
	s.C.ImportImage(t, node.Path, imagebuild.NodeRef, "tidepool")
	return s
}

// taskPid is the host pid of a container's task.
func taskPid(t testing.TB, s *stack.Stack, id string) int {
	t.Helper()
	for _, line := range strings.Split(s.MustCtr(t, "task", "ls"), "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[0] == id {
			pid, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatalf("task ls: %q", line)
			}
			return pid
		}
	}
	t.Fatalf("no task %s", id)
	return 0
}

// waitFile waits until path exists (a container's file seen through /proc/PID/root).
func waitFile(t testing.TB, s *stack.Stack, path string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared\n%s", path, s.Daemon.LogTail(30))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// branchResult is `tidepool fork --container --json`.
type branchResult struct {
	Container, Namespace, Root, Base, Pause string
	ForkID                                  string  `json:"fork_id"`
	SnapshotKey                             string  `json:"snapshot_key"`
	PausedMs                                float64 `json:"paused_ms"`
	TotalMs                                 float64 `json:"total_ms"`
	Files                                   int64
	Forks                                   []forks.Fork
}

func forkContainer(t testing.TB, s *stack.Stack, id string, args ...string) branchResult {
	t.Helper()
	out := s.MustTidepool(t, append([]string{"fork", "--container", id, "--namespace", s.C.Namespace, "--json"}, args...)...)
	var r branchResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return r
}

// parentScript writes 100 files under /src, deletes one of the fork's, says ready,
// then keeps writing loop/N (N = 1, 2, ...) until /src/stop appears, and says done.
// With set -e any failed write ends it before done: the container must see no error.
const parentScript = `set -e; cd /src; mkdir -p gen loop
i=0; while [ $i -lt 100 ]; do echo "file $i" > gen/f$i.txt; i=$((i+1)); done
rm src/old.js; echo more >> README.md; echo ready > /tmp/ready
n=0; while [ ! -e /src/stop ]; do n=$((n+1)); echo $n > loop/$n; sleep 0.005; done
echo $n > /tmp/done; exec sleep 100000`

// TestBranchRunningContainer: a container that has written 100 files keeps running
// and writing while it is forked 3 ways; each branch, run in a warm pool member,
// sees exactly the parent's files at the fork; the parent's later writes stay out of
// the branches; the parent's own commit on removal is exactly its merged workdir.
func TestBranchRunningContainer(t *testing.T) {
	s := branchStack(t, 3)
	root := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "node", 3)
	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, forkLabels(root, branchWorkdir)...),
		imagebuild.NodeRef, "parent", "sh", "-c", parentScript)...)
	pid := taskPid(t, s, "parent")
	proot := fmt.Sprintf("/proc/%d/root", pid)
	waitFile(t, s, proot+"/tmp/ready")
	waitFile(t, s, proot+"/src/loop/3")

	res := forkContainer(t, s, "parent", "--count", "3", "--label", "try")
	t.Logf("fork --container: pause %s %.2f ms, total %.2f ms in tidepoold, %d files", res.Pause, res.PausedMs, res.TotalMs, res.Files)
	if len(res.Forks) != 3 || res.Pause != "freezer" || res.PausedMs <= 0 || res.Base != root || res.Container != "parent" {
		t.Fatalf("fork answer %+v", res)
	}
	own := res.ForkID
	// The branch: the fork's files with the parent's changes, and a prefix of the
	// loop's files (the last one may be caught between its open and its write).
	branchDir := filepath.Join(t.TempDir(), "branch")
	s.MustTidepool(t, "checkout", res.Root, branchDir)
	k := checkBranchTree(t, branchDir)
	for i, f := range res.Forks {
		if f.Root.String() != res.Root || f.Base.String() != root || f.Label != fmt.Sprintf("try-%d", i+1) ||
			f.Labels["tidepool.dev/branch-of-container"] != s.C.Namespace+"/parent" {
			t.Fatalf("branch %d: %+v", i, f)
		}
	}
	// The parent keeps running and writing, without an error.
	waitFile(t, s, fmt.Sprintf("%s/src/loop/%d", proot, k+20))
	if f := forkByID(t, s, own); f.Root.String() != root {
		t.Fatalf("the parent's own fork moved to %s", f.Root)
	}

	// Each branch continues in a warm member, which sees exactly the branch.
	want := listing(t, branchDir)
	for i, f := range res.Forks {
		out, errOut, code := tidepoolRun(t, s, "", "--pool", "node", "--fork", f.ID, "--",
			"sh", "-c", fmt.Sprintf("cd /src && find . -type f | sort | xargs md5sum && echo %d > branch.txt", i))
		if code != 0 {
			t.Fatalf("branch %d in a member: exit %d: %s", i, code, errOut)
		}
		if out != want {
			t.Fatalf("branch %d as a member sees it:\n%s\nwant:\n%s", i, firstDiff(out, want), "")
		}
		if d := s.MustTidepool(t, "diff", res.Root, f.ID); d != "A branch.txt\n" {
			t.Fatalf("branch %d after its run: %q", i, d)
		}
	}

	// Stop the parent's loop, take its merged workdir, remove it: its commit is that.
	if err := os.WriteFile(proot+"/src/stop", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFile(t, s, proot+"/tmp/done")
	merged := ingestMerged(t, s, proot+"/src")
	last, _ := os.ReadFile(proot + "/tmp/done")
	s.MustCtr(t, "task", "kill", "-s", "KILL", "parent")
	waitTaskGone(t, s, "parent")
	s.MustCtr(t, "container", "rm", "parent")
	f := s.WaitFork(t, "parent's commit", func(f forks.Fork) bool { return f.ID == own && f.Root.String() != root })
	if f.Root.String() != merged {
		t.Fatalf("parent's commit %s, its merged workdir %s", f.Root, merged)
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(last)))
	if n <= k+20 {
		t.Fatalf("parent wrote %d loop files, %d at the branch", n, k)
	}
	// The parent's later writes are not in the branches, nor the branches' in it.
	d := s.MustTidepool(t, "diff", res.Root, own)
	for _, line := range strings.Split(strings.TrimSpace(d), "\n") {
		var n int
		switch {
		case line == "A stop":
		case strings.HasPrefix(line, "A loop/"):
			n, _ = strconv.Atoi(strings.TrimPrefix(line, "A loop/"))
			if n <= k {
				t.Fatalf("parent vs branch: %s", line)
			}
		case line == fmt.Sprintf("M loop/%d", k): // caught between open and write
		default:
			t.Fatalf("parent vs branch: unexpected %q in\n%s", line, d)
		}
	}
	if !strings.Contains(d, fmt.Sprintf("A loop/%d\n", k+1)) {
		t.Fatalf("parent's later writes missing from its commit:\n%s", d)
	}
	for _, b := range res.Forks {
		if d := s.MustTidepool(t, "diff", res.Root, b.ID); d != "A branch.txt\n" {
			t.Fatalf("branch %s moved: %q", b.ID, d)
		}
	}
	waitPool(t, s, "node", 3)
}

// ingestMerged ingests a container's directory seen through /proc/PID/root, copied
// out first (the CLI resolves a path's symlinks, /proc/PID/root is one, and a bind
// mount of another mount namespace's path is refused).
func ingestMerged(t *testing.T, s *stack.Stack, dir string) string {
	t.Helper()
	cp := filepath.Join(t.TempDir(), "merged")
	if out, err := exec.Command("cp", "-a", dir+"/.", cp).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", dir, err, out)
	}
	return s.Ingest(t, cp)
}

// checkBranchTree checks a checked-out branch: the fork's files with the parent's
// changes and loop files 1..k, every one whole but possibly the last; returns k.
func checkBranchTree(t *testing.T, dir string) int {
	t.Helper()
	read := func(p string) string {
		b, err := os.ReadFile(filepath.Join(dir, p))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	for i := 0; i < 100; i++ {
		if got := read(fmt.Sprintf("gen/f%d.txt", i)); got != fmt.Sprintf("file %d\n", i) {
			t.Fatalf("gen/f%d.txt: %q", i, got)
		}
	}
	if got := read("README.md"); got != appSource["README.md"]+"more\n" {
		t.Fatalf("README.md: %q", got)
	}
	if _, err := os.Stat(filepath.Join(dir, "src/old.js")); !os.IsNotExist(err) {
		t.Fatalf("src/old.js in the branch: %v", err)
	}
	ents, err := os.ReadDir(filepath.Join(dir, "loop"))
	if err != nil {
		t.Fatal(err)
	}
	var ns []int
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			t.Fatalf("loop/%s", e.Name())
		}
		ns = append(ns, n)
	}
	sort.Ints(ns)
	k := len(ns)
	if k < 3 {
		t.Fatalf("branch has %d loop files", k)
	}
	for i, n := range ns {
		if n != i+1 {
			t.Fatalf("loop files are not 1..%d: %v", k, ns)
		}
		got := read(fmt.Sprintf("loop/%d", n))
		if got != fmt.Sprintf("%d\n", n) && !(n == k && got == "") {
			t.Fatalf("loop/%d: %q", n, got)
		}
	}
	return k
}

// listing is `find . -type f | sort | xargs md5sum` run in dir, as a member runs it.
func listing(t *testing.T, dir string) string {
	t.Helper()
	cmd := exec.Command("sh", "-c", "find . -type f | LC_ALL=C sort | xargs md5sum")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func firstDiff(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		var a, b string
		if i < len(g) {
			a = g[i]
		}
		if i < len(w) {
			b = w[i]
		}
		if a != b {
			return fmt.Sprintf("line %d: got %q want %q (%d vs %d lines)", i+1, a, b, len(g), len(w))
		}
	}
	return "equal"
}

func forkByID(t testing.TB, s *stack.Stack, id string) forks.Fork {
	t.Helper()
	for _, f := range s.Forks(t) {
		if f.ID == id {
			return f
		}
	}
	t.Fatalf("no fork %s", id)
	return forks.Fork{}
}

func waitTaskGone(t testing.TB, s *stack.Stack, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := s.Ctr("task", "rm", id); err == nil {
			return
		}
		if out := s.MustCtr(t, "task", "ls"); !strings.Contains(out, "\n"+id+" ") {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("task %s still there: %s", id, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestBranchErrors: unknown container, a container without a fork, one not running
// and one paused get clear errors naming the container; nothing is left behind and
// a paused container stays paused.
func TestBranchErrors(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	ns := s.C.Namespace
	s.MustCtr(t, "run", "-d", "--fifo-dir", s.C.FIFODir, "--snapshotter", "tidepool", imagebuild.BusyboxRef, "plain", "sleep", "1000")
	s.MustCtr(t, append(append([]string{"container", "create"}, forkLabels(root, "/app")...), imagebuild.BusyboxRef, "created", "true")...)
	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/app")...), imagebuild.BusyboxRef, "paused", "sleep", "1000")...)
	s.MustCtr(t, "task", "pause", "paused")
	for id, want := range map[string]string{
		"nope":    "container " + ns + "/nope: no such container",
		"plain":   "container " + ns + "/plain",
		"created": "container " + ns + "/created is not running",
		"paused":  "container " + ns + "/paused is not running (task paused)",
	} {
		out, err := s.Tidepool("fork", "--container", id, "--namespace", ns)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("fork --container %s: %q, %v; want an error with %q", id, out, err, want)
		}
	}
	if _, err := s.Tidepool("fork", "--container", "plain", "--namespace", ns); err == nil || !strings.Contains(err.Error(), "no source fork") {
		t.Errorf("plain container: %v", err)
	}
	if _, err := s.Tidepool("fork", "--container", "nope", "--namespace", "default"); err == nil || !strings.Contains(err.Error(), "default/nope") {
		t.Errorf("other namespace: %v", err)
	}
	if out := s.MustCtr(t, "task", "ls"); !strings.Contains(out, "PAUSED") {
		t.Errorf("the paused container was resumed:\n%s", out)
	}
	for _, f := range s.Forks(t) {
		if f.Labels["tidepool.dev/branch-of-container"] != "" {
			t.Errorf("a refused branch left fork %+v", f)
		}
	}
	s.MustCtr(t, "task", "resume", "paused")
	for _, id := range []string{"plain", "paused"} {
		s.MustCtr(t, "task", "kill", "-s", "KILL", id)
		waitTaskGone(t, s, id)
		s.MustCtr(t, "container", "rm", id)
	}
	s.MustCtr(t, "container", "rm", "created")
	s.C.LeakCheck(t)
	waitViewsReleased(t, s)
}

// TestBranchThroughShim: a container run by containerd-shim-tidepool-v1 with the
// fork from annotations is branched the same way, and keeps running.
func TestBranchThroughShim(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	flags := append(shimFlags(t, s, ""), annotations(binding.AnnotationFork+"="+root, binding.AnnotationWorkdir+"="+branchWorkdir)...)
	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, flags...), imagebuild.BusyboxRef, "shimmed", "sh", "-c", parentScript)...)
	proot := fmt.Sprintf("/proc/%d/root", taskPid(t, s, "shimmed"))
	waitFile(t, s, proot+"/src/loop/3")
	res := forkContainer(t, s, "shimmed")
	if len(res.Forks) != 1 || res.Forks[0].Label != "" {
		t.Fatalf("fork answer %+v", res)
	}
	dir := filepath.Join(t.TempDir(), "b")
	s.MustTidepool(t, "checkout", res.Root, dir)
	k := checkBranchTree(t, dir)
	waitFile(t, s, fmt.Sprintf("%s/src/loop/%d", proot, k+10))
	s.MustCtr(t, "task", "kill", "-s", "KILL", "shimmed")
	waitTaskGone(t, s, "shimmed")
	s.MustCtr(t, "container", "rm", "shimmed")
	s.C.LeakCheck(t)
	waitViewsReleased(t, s)
}

// waitViewsReleased waits until no fork view is mounted under the daemon's root: a
// removed container's snapshot goes, and its view with it, only when containerd
// collects it, and kernel views stay mounted when tidepoold stops, so a test that
// ends right after a removal would leave them to the stack's leak check.
func waitViewsReleased(t testing.TB, s *stack.Stack) {
	t.Helper()
	waitFor(t, "the views of removed snapshots released", func() string {
		if left, _ := harness.MountsUnder(filepath.Join(s.Root, "views")); len(left) > 0 {
			return fmt.Sprintf("mounted: %v", left)
		}
		return ""
	})
}

// TestBranchFront: `tidepool fork --container` is served by the front binary alone
// (over the run socket; no full CLI beside it or on PATH), and answers exactly as the
// full CLI does: for one request id both return the same forks, the same JSON fields
// and the same lines, and a refusal reads the same.
func TestBranchFront(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))
	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, forkLabels(root, branchWorkdir)...),
		imagebuild.BusyboxRef, "front", "sh", "-c", "echo x > /src/new.txt; exec sleep 1000")...)
	proot := fmt.Sprintf("/proc/%d/root", taskPid(t, s, "front"))
	waitFile(t, s, proot+"/src/new.txt")

	alone := t.TempDir()
	b, err := os.ReadFile(filepath.Join(s.Bin, "tidepool"))
	if err != nil {
		t.Fatal(err)
	}
	front := filepath.Join(alone, "tidepool")
	if err := os.WriteFile(front, b, 0o755); err != nil {
		t.Fatal(err)
	}
	run := func(bin string, args ...string) (string, string, error) {
		cmd := exec.Command(bin, append([]string{"--root", s.Root, "fork", "--container", "front", "--namespace", s.C.Namespace}, args...)...)
		cmd.Env = append(os.Environ(), "PATH="+alone+":/usr/bin:/bin")
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		return stdout.String(), stderr.String(), err
	}
	full := filepath.Join(s.Bin, "tidepool-cli")
	scrub := func(out string) map[string]any {
		var m map[string]any
		if err := json.Unmarshal([]byte(out), &m); err != nil {
			t.Fatalf("%v: %q", err, out)
		}
		for k := range m {
			if strings.HasSuffix(k, "_ms") {
				delete(m, k)
			}
		}
		return m
	}
	args := []string{"--count", "2", "--label", "try", "--label-kv", "k=v", "--request-id", "front-1", "--json"}
	fo, fe, err := run(front, args...)
	if err != nil {
		t.Fatalf("front alone: %v: %s", err, fe)
	}
	co, ce, err := run(full, args...)
	if err != nil {
		t.Fatalf("full CLI: %v: %s", err, ce)
	}
	if f, c := scrub(fo), scrub(co); !reflect.DeepEqual(f, c) {
		t.Fatalf("the front and the full CLI answer differently:\nfront %s\nfull  %s", fo, co)
	}
	var res branchResult
	json.Unmarshal([]byte(fo), &res)
	if len(res.Forks) != 2 || res.Forks[0].Label != "try-1" || res.Forks[1].Label != "try-2" || res.Forks[0].Labels["k"] != "v" {
		t.Fatalf("branch answer %s", fo)
	}
	if d := s.MustTidepool(t, "diff", root, res.Forks[0].ID); d != "A new.txt\n" {
		t.Fatalf("branch changes %q", d)
	}
	lines, _, err := run(front, "--count", "2", "--label", "try", "--label-kv", "k=v", "--request-id", "front-1")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%s %s try-1\n%s %s try-2\n", res.Forks[0].ID, res.Forks[0].Root, res.Forks[1].ID, res.Forks[1].Root)
	if cl, _, _ := run(full, "--count", "2", "--label", "try", "--label-kv", "k=v", "--request-id", "front-1"); lines != want || cl != want {
		t.Fatalf("lines: front %q, full %q, want %q", lines, cl, want)
	}
	for _, bad := range [][]string{{"--count", "0"}, {"--label-kv", "novalue"}, {"--label", strings.Repeat("a", 64)}} {
		_, fe, ferr := run(front, bad...)
		_, ce, cerr := run(full, bad...)
		if ferr == nil || cerr == nil || fe != ce {
			t.Errorf("%v: front %v %q, full CLI %v %q: want the same refusal", bad, ferr, fe, cerr, ce)
		}
	}
	s.MustCtr(t, "task", "kill", "-s", "KILL", "front")
	waitTaskGone(t, s, "front")
	s.MustCtr(t, "container", "rm", "front")
	waitViewsReleased(t, s)
}

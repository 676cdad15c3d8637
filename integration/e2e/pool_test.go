package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/localapi"
)

// poolStack starts a stack whose tidepoold keeps a pool of the Node image.
func poolStack(t testing.TB, target int, extra string) *stack.Stack {
	t.Helper()
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{Metrics: true, TidepooldConfig: func(s *stack.Stack) string {
		return s.PoolConfig(stack.Pool{Name: "node", Image: imagebuild.NodeRef, Target: target, Extra: extra})
	}})
	s.C.ImportImage(t, node.Path, imagebuild.NodeRef, "tidepool")
	return s
}

type poolState struct{ idle, claimed, starting int }

func poolStatus(t testing.TB, s *stack.Stack, name string) poolState {
	t.Helper()
	for _, line := range strings.Split(s.MustTidepool(t, "pools"), "\n") {
		f := strings.Fields(line)
		if len(f) >= 4 && f[0] == name {
			var st poolState
			fmt.Sscan(f[1], &st.idle)
			fmt.Sscan(f[2], &st.claimed)
			fmt.Sscan(f[3], &st.starting)
			return st
		}
	}
	t.Fatalf("pool %s not listed", name)
	return poolState{}
}

func waitPool(t testing.TB, s *stack.Stack, name string, idle int) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		st := poolStatus(t, s, name)
		if st.idle == idle && st.claimed == 0 && st.starting == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s is %+v, want %d idle\n%s", name, st, idle, s.Daemon.LogTail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tidepoolRun runs `tidepool run` and returns stdout, stderr and the exit code.
func tidepoolRun(t testing.TB, s *stack.Stack, stdin string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(filepath.Join(s.Bin, "tidepool"), append([]string{"--root", s.Root, "run"}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

func TestPoolRun(t *testing.T) {
	s := poolStack(t, 2, "")
	root := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "node", 2)

	script := "node /app/src/main.js && cat > /app/from-stdin.txt && echo to-stderr >&2 && pwd && echo $GREETING; exit 3"
	out, errOut, code := tidepoolRun(t, s, "piped in\n", "--pool", "node", "--fork", root, "--env", "GREETING=hi", "--", "sh", "-c", script)
	if code != 3 || out != "hello Tidepool\n/app\nhi\n" || !strings.HasPrefix(errOut, "to-stderr\n") {
		t.Fatalf("exit %d\nstdout %q\nstderr %q", code, out, errOut)
	}
	// The fork's new root is reported, and holds exactly the command's writes.
	var forkID string
	for _, line := range strings.Split(errOut, "\n") {
		if rest, ok := strings.CutPrefix(line, "tidepool: fork "); ok {
			forkID = strings.Fields(rest)[0]
		}
	}
	if forkID == "" {
		t.Fatalf("no fork reported: %q", errOut)
	}
	if d := s.MustTidepool(t, "diff", root, forkID); d != "A from-stdin.txt\n" {
		t.Fatalf("fork changes %q", d)
	}
	if got := s.MustTidepool(t, "cat", forkID, "from-stdin.txt"); got != "piped in\n" {
		t.Fatalf("stdin reached the workload as %q", got)
	}
	// Exit statuses and missing commands behave as a shell's.
	if _, _, code := tidepoolRun(t, s, "", "--pool", "node", "--", "true"); code != 0 {
		t.Fatalf("true exited %d", code)
	}
	if _, e, code := tidepoolRun(t, s, "", "--pool", "node", "--", "no-such-command"); code != 127 || !strings.Contains(e, "not found") {
		t.Fatalf("missing command: exit %d, stderr %q", code, e)
	}
	if _, e, code := tidepoolRun(t, s, "", "--pool", "nope", "--", "true"); code != 1 || !strings.Contains(e, `no pool "nope"`) {
		t.Fatalf("unknown pool: exit %d, stderr %q", code, e)
	}
	waitPool(t, s, "node", 2)
}

// TestPoolSignalDeath: a workload killed by a signal reports 128+N, as a cold
// container killed the same way does through ctr.
func TestPoolSignalDeath(t *testing.T) {
	s := poolStack(t, 1, "")
	waitPool(t, s, "node", 1)
	client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	sigs := make(chan os.Signal, 1)
	var out syncBuffer
	done := make(chan struct{})
	var exit *apiv1.RunExit
	go func() {
		defer close(done)
		exit, err = client.Run(context.Background(), &apiv1.RunStart{Pool: "node", Args: []string{"sh", "-c", "echo up; sleep 1000"}},
			localapi.RunStreams{Stdout: &out, Stderr: &out, Signals: sigs})
	}()
	for !strings.Contains(out.String(), "up") {
		time.Sleep(20 * time.Millisecond)
	}
	sigs <- syscall.SIGKILL
	<-done
	if err != nil || exit.GetStatus() != 137 {
		t.Fatalf("warm workload killed: %+v %v", exit, err)
	}

	// The same workload, cold, killed through ctr.
	cold := exec.Command(ctrPath(t), "--address", s.C.Address, "--namespace", s.C.Namespace, "run", "--rm", "--fifo-dir", s.C.FIFODir,
		"--snapshotter", "tidepool", imagebuild.NodeRef, "cold-kill", "sh", "-c", "echo up; sleep 1000")
	var coldOut syncBuffer
	cold.Stdout = &coldOut
	if err := cold.Start(); err != nil {
		t.Fatal(err)
	}
	for !strings.Contains(coldOut.String(), "up") {
		time.Sleep(20 * time.Millisecond)
	}
	s.MustCtr(t, "task", "kill", "-s", "KILL", "cold-kill")
	cold.Wait()
	if code := cold.ProcessState.ExitCode(); code != 137 {
		t.Fatalf("cold container killed: exit %d", code)
	}
}

// TestPoolHundredClaims: 100 claims in a row from a pool of target 4, each correct,
// and afterwards nothing leaked: the pool is back at target, with exactly its members'
// containers, snapshots, views, mounts and cgroups.
func TestPoolHundredClaims(t *testing.T) {
	s := poolStack(t, 4, "")
	root := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "node", 4)
	client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	var claims []float64
	forksSeen := map[string]bool{}
	for i := 0; i < 100; i++ {
		var out, errOut bytes.Buffer
		exit, err := client.Run(context.Background(), &apiv1.RunStart{
			Pool: "node", Fork: root, Args: []string{"sh", "-c", fmt.Sprintf("cat README.md && echo %d > n.txt && echo %d", i, i)},
		}, localapi.RunStreams{Stdout: &out, Stderr: &errOut})
		if err != nil {
			t.Fatalf("claim %d: %v", i, err)
		}
		if want := appSource["README.md"] + fmt.Sprintf("%d\n", i); out.String() != want || exit.GetStatus() != 0 || errOut.Len() != 0 {
			t.Fatalf("claim %d: exit %d stdout %q stderr %q", i, exit.GetStatus(), out.String(), errOut.String())
		}
		if forksSeen[exit.GetForkId()] || exit.GetForkId() == "" {
			t.Fatalf("claim %d: fork %q reused or missing", i, exit.GetForkId())
		}
		forksSeen[exit.GetForkId()] = true
		if got := s.MustTidepool(t, "cat", exit.GetForkId(), "n.txt"); got != fmt.Sprintf("%d\n", i) {
			t.Fatalf("claim %d: fork holds %q", i, got)
		}
		claims = append(claims, exit.GetClaimMs())
	}
	sort.Float64s(claims)
	t.Logf("100 claims: claim latency p50 %.1f ms, p99 %.1f ms", claims[49], claims[98])
	waitPool(t, s, "node", 4)
	waitFor(t, "only the 4 members left", func() string {
		return checkOnlyMembers(t, s, 4)
	})
}

// checkOnlyMembers returns "" when containerd, the snapshotter, the view host and the
// mount table hold exactly n pool members and nothing else, else what is off.
func checkOnlyMembers(t testing.TB, s *stack.Stack, n int) string {
	ctrs := strings.Fields(s.MustCtr(t, "container", "ls", "-q"))
	if len(ctrs) != n {
		return fmt.Sprintf("%d containers: %v", len(ctrs), ctrs)
	}
	var active []string
	for _, line := range strings.Split(s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "ls"), "\n") {
		if strings.Contains(line, "Active") {
			active = append(active, strings.Fields(line)[0])
		}
	}
	if len(active) != n {
		return fmt.Sprintf("%d active snapshots: %v (containers %v)", len(active), active, ctrs)
	}
	views := viewDirs(s)
	mounts, _ := harness.MountsUnder(s.Root)
	if views != n || len(mounts) != n {
		return fmt.Sprintf("%d view and slot dirs, %d mounts under the root: %v", views, len(mounts), mounts)
	}
	cgs, _ := harness.CgroupDirs("/" + s.C.Namespace)
	for _, cg := range cgs {
		ents, _ := os.ReadDir(cg)
		var dirs []string
		for _, e := range ents {
			if e.IsDir() {
				dirs = append(dirs, e.Name())
			}
		}
		if len(dirs) != n {
			return fmt.Sprintf("%d container cgroups under %s: %v (containers %v)", len(dirs), cg, dirs, ctrs)
		}
	}
	return ""
}

// viewDirs counts the view and slot directories under the daemon's root: one per
// member, a late-bound FUSE view's or (kernel views) its slot's, until a claim
// mounts a view for the slot.
func viewDirs(s *stack.Stack) int {
	views, _ := os.ReadDir(filepath.Join(s.Root, "views"))
	slots, _ := os.ReadDir(filepath.Join(s.Root, "slots"))
	return len(views) + len(slots)
}

func waitFor(t testing.TB, what string, check func() string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		msg := check()
		if msg == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s", what, msg)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestPoolReconcileAfterDaemonKill: tidepoold killed with SIGKILL while idle members
// exist. Their fork views died with it (views are served in-process), so the new
// daemon cannot hand them a fork: it destroys them and refills; claims work and
// nothing leaks.
func TestPoolReconcileAfterDaemonKill(t *testing.T) {
	s := poolStack(t, 3, "")
	root := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "node", 3)
	before := strings.Fields(s.MustCtr(t, "container", "ls", "-q"))
	if err := s.Daemon.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
	waitPool(t, s, "node", 3)
	after := strings.Fields(s.MustCtr(t, "container", "ls", "-q"))
	for _, id := range before {
		for _, a := range after {
			if a == id {
				t.Fatalf("member %s, whose view died, is still in the pool", id)
			}
		}
	}
	out, _, code := tidepoolRun(t, s, "", "--pool", "node", "--fork", root, "--", "cat", "README.md")
	if code != 0 || out != appSource["README.md"] {
		t.Fatalf("claim after restart: exit %d, %q", code, out)
	}
	waitPool(t, s, "node", 3)
	waitFor(t, "only the members left", func() string { return checkOnlyMembers(t, s, 3) })
}

// TestPoolTransparentAdoption: a container created with --runtime tidepool and the
// dev.tidepool.pool annotation (as `nerdctl run` would) adopts a warm member. For ctr
// it is an ordinary container: its task's pid, output, exit status, kill and delete,
// and its snapshot (re-keyed to the member's data) behave as a cold one's. A
// container that is not eligible (an extra mount) starts cold, and that is counted.
func TestPoolTransparentAdoption(t *testing.T) {
	s := poolStack(t, 2, "")
	root := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "node", 2)
	flags := append(shimFlags(t, s, ""), annotations("dev.tidepool.pool=node", "dev.tidepool.fork="+root, "dev.tidepool.workdir=/app")...)

	out, err := s.Ctr(append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, flags...), imagebuild.NodeRef, "adopt1",
		"sh", "-c", "node /app/src/main.js; echo more >> /app/README.md; echo to-stderr >&2; exit 5")...)
	if err == nil || !strings.Contains(err.Error(), "exit status 5") || out != "hello Tidepool\n" {
		t.Fatalf("adopted run: stdout %q, err %v", out, err)
	}
	if n := s.Metric(t, "tidepool_pool_claim_seconds_count", `pool="node"`); n != 1 {
		t.Fatalf("%v warm claims recorded, want 1 (the container did not adopt a member)", n)
	}
	f := forkOfContainer(t, s, "adopt1", root)
	if d := s.MustTidepool(t, "diff", root, f.ID); d != "M README.md\n" {
		t.Fatalf("adopted container's fork changes %q", d)
	}

	// Detached: ctr sees an ordinary task, and the snapshot is the member's data.
	waitPool(t, s, "node", 2)
	s.MustCtr(t, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, flags...), imagebuild.NodeRef, "adopt2", "sleep", "1000")...)
	waitStatus(t, s, "adopt2", "RUNNING")
	var member string
	for _, id := range strings.Fields(s.MustCtr(t, "container", "ls", "-q")) {
		if info := s.MustCtr(t, "container", "info", id); strings.Contains(info, `"dev.tidepool.adopted-by": "adopt2"`) {
			member = id
		}
	}
	if member == "" {
		t.Fatal("no member records adopt2 as its adopter")
	}
	// The container's snapshot is the member's: its fork view is in its rootfs
	// (late-bound FUSE view), or on its slot (kernel views).
	if m := s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "mounts", "/x", "adopt2"); !strings.Contains(m, "/views/") && !slotBound(t, s, m) {
		t.Fatalf("adopt2's snapshot is not the member's (no fork view): %s", m)
	}
	s.MustCtr(t, "task", "kill", "-s", "KILL", "adopt2")
	waitStatus(t, s, "adopt2", "STOPPED")
	s.MustCtr(t, "task", "rm", "adopt2")
	s.MustCtr(t, "container", "rm", "adopt2")

	// Not eligible: an extra bind mount was not in the template. It starts cold.
	cold := append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir, "--mount", "type=bind,src=/etc,dst=/host-etc,options=rbind:ro"}, flags...),
		imagebuild.NodeRef, "cold1", "sh", "-c", "test -f /host-etc/passwd && node /app/src/main.js")
	if out := s.MustCtr(t, cold...); out != "hello Tidepool\n" {
		t.Fatalf("cold fallback printed %q", out)
	}
	if n := s.Metric(t, "tidepool_pool_cold_fallbacks_total", `pool="node"`, `reason="mounts"`); n != 1 {
		t.Fatalf("cold fallbacks for mounts: %v, want 1", n)
	}
	waitPool(t, s, "node", 2)
	waitFor(t, "only the members left", func() string { return checkOnlyMembers(t, s, 2) })
}

// slotBound reports whether the snapshot whose mount command is mounts (ctr
// snapshot mounts) has a view mounted onto its slot.
func slotBound(t testing.TB, s *stack.Stack, mounts string) bool {
	t.Helper()
	m := snapshotUpper.FindStringSubmatch(mounts)
	if m == nil {
		return false
	}
	slot := filepath.Join(s.Root, "slots", m[1])
	ms, _ := harness.MountsUnder(slot)
	n := 0
	for _, m := range ms {
		if m == slot {
			n++
		}
	}
	return n >= 2 // the slot, and the overlay on it
}

// syncBuffer is a bytes.Buffer safe for one writer and one polling reader.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestPoolRunGoSourceTree: a claim with a fork of the Go source tree runs node (a
// baked dependency) with lodash (from the image's node_modules) over the fork's Go
// sources, and what it writes lands on the fork.
func TestPoolRunGoSourceTree(t *testing.T) {
	s := poolStack(t, 1, "")
	root := s.Ingest(t, filepath.Join(runtime.GOROOT(), "src"))
	waitPool(t, s, "node", 1)
	script := `const _ = require('/app/node_modules/lodash'); const fs = require('fs');
const files = fs.readdirSync('/app/net/http').filter(f => f.endsWith('.go'));
const lines = _.sumBy(files, f => fs.readFileSync('/app/net/http/' + f, 'utf8').split('\n').length);
fs.writeFileSync('/app/LINES', String(lines));
console.log(files.length + ' ' + lines);`
	out, errOut, code := tidepoolRun(t, s, "", "--pool", "node", "--fork", root, "--", "node", "-e", script)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var files, lines int
	if _, err := fmt.Sscan(out, &files, &lines); err != nil || files < 50 || lines < 10000 {
		t.Fatalf("node over net/http printed %q", out)
	}
	// The same count, computed on the host's copy of the tree.
	ents, _ := os.ReadDir(filepath.Join(runtime.GOROOT(), "src", "net", "http"))
	hostFiles, hostLines := 0, 0
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".go") {
			b, _ := os.ReadFile(filepath.Join(runtime.GOROOT(), "src", "net", "http", e.Name()))
			hostFiles++
			hostLines += len(strings.Split(string(b), "\n"))
		}
	}
	if files != hostFiles || lines != hostLines {
		t.Fatalf("container counted %d files, %d lines; the host tree has %d, %d", files, lines, hostFiles, hostLines)
	}
	var forkID string
	for _, line := range strings.Split(errOut, "\n") {
		if rest, ok := strings.CutPrefix(line, "tidepool: fork "); ok {
			forkID = strings.Fields(rest)[0]
		}
	}
	if d := s.MustTidepool(t, "diff", root, forkID); d != "A LINES\n" {
		t.Fatalf("fork changes %q", d)
	}
}

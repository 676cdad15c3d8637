package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/shim"
)

// densityStack starts a stack whose tidepoold keeps a pool "dense" of busybox members,
// groupSize members to a shim, each group's shim kept up for grace once empty. The
// baseline is taken before the image arrives, so before any member exists.
func densityStack(t testing.TB, target, groupSize int, grace string) (*stack.Stack, baseline) {
	t.Helper()
	archive := imagebuild.BusyboxArchive(t)
	s := stack.Start(t, stack.Options{TidepooldConfig: func(s *stack.Stack) string {
		return s.PoolConfig(stack.Pool{Name: "dense", Image: imagebuild.BusyboxRef, Target: target,
			Extra: fmt.Sprintf("shim_group_size = %d\nshim_group_grace = %q\n", groupSize, grace)})
	}})
	before := measureBaseline(s)
	s.C.ImportImage(t, archive.Path, imagebuild.BusyboxRef, "tidepool")
	return s, before
}

// waitPoolLong is waitPool with a deadline for large pools on a loaded machine.
func waitPoolLong(t testing.TB, s *stack.Stack, name string, idle int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		st := poolStatus(t, s, name)
		if st.idle == idle && st.claimed == 0 && st.starting == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s is %+v, want %d idle\n%s", name, st, idle, s.Daemon.LogTail(40))
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// memberGroups maps each member container to its shim group annotation.
func memberGroups(t testing.TB, s *stack.Stack) map[string]string {
	t.Helper()
	cl, err := s.C.Client(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx := s.C.Context(context.Background())
	ctrs, err := cl.Containers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, c := range ctrs {
		spec, err := c.Spec(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out[c.ID()] = spec.Annotations[binding.AnnotationShimGroup]
	}
	return out
}

func tidepoolShims(t testing.TB, s *stack.Stack) []harness.Process {
	t.Helper()
	return shimProcessesNamed(t, s, "containerd-shim-tidepool-v1")
}

// shimReport says which shims serve the members (every holder's parent is its
// shim), and whether there is exactly one shim per group.
func shimReport(t testing.TB, s *stack.Stack) (string, bool) {
	t.Helper()
	groups := map[string]int{}
	members := 0
	for id, g := range memberGroups(t, s) {
		if g == "" {
			return fmt.Sprintf("member %s has no shim group", id), false
		}
		groups[g]++
		members++
	}
	shims := tidepoolShims(t, s)
	served := map[string]int{}
	for _, line := range strings.Split(s.MustCtr(t, "task", "ls"), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] != "TASK" {
			served[fmt.Sprint(procKiB("/proc/"+f[1]+"/status", "PPid:"))]++
		}
	}
	var list []string
	for _, p := range shims {
		list = append(list, fmt.Sprintf("pid %d (%d members) %s", p.Pid, served[fmt.Sprint(float64(p.Pid))], strings.Join(p.Cmdline, " ")))
	}
	msg := fmt.Sprintf("%d members in %d groups %v are served by %d shims:\n  %s", members, len(groups), groups, len(shims), strings.Join(list, "\n  "))
	return msg, len(shims) == len(groups)
}

// checkSharedShims fails unless the members are served by exactly one shim per group.
func checkSharedShims(t testing.TB, s *stack.Stack) {
	t.Helper()
	var msg string
	waitFor(t, "one shim per group", func() string {
		var ok bool
		if msg, ok = shimReport(t, s); ok {
			return ""
		}
		return msg
	})
	t.Log(msg)
}

// idleCost is what the idle members of a stack cost, in KiB per member.
type idleCost struct {
	members                  int
	holderPSS, shimPSS, kmem float64 // per member
	daemon                   float64 // tidepoold's and containerd's RSS growth, per member
	memAvailable             float64 // drop of MemAvailable, per member (the whole host: noisy)
	shims                    int
}

func (c idleCost) total() float64 { return c.holderPSS + c.shimPSS + c.kmem + c.daemon }

func (c idleCost) String() string {
	return fmt.Sprintf("%d members, %d shims: per member %.0f KiB = holder PSS %.0f + shim PSS %.0f + cgroup kernel memory %.0f + tidepoold and containerd RSS growth %.0f (host MemAvailable drop, noisy: %.0f KiB per member)",
		c.members, c.shims, c.total(), c.holderPSS, c.shimPSS, c.kmem, c.daemon, c.memAvailable)
}

// procKiB reads one field of a /proc file in kB ("Pss:" of smaps_rollup, "VmRSS:" of
// status, "MemAvailable:" of meminfo).
func procKiB(path, field string) float64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return kb
		}
	}
	return 0
}

// baseline is what is measured before the pool fills.
type baseline struct{ daemonKiB, memAvailableKiB float64 }

func daemonsRSS(s *stack.Stack) float64 {
	return procKiB(fmt.Sprintf("/proc/%d/status", s.Daemon.Pid()), "VmRSS:") + procKiB(fmt.Sprintf("/proc/%d/status", s.C.Pid()), "VmRSS:")
}

func measureBaseline(s *stack.Stack) baseline {
	return baseline{
		daemonKiB:       daemonsRSS(s),
		memAvailableKiB: procKiB("/proc/meminfo", "MemAvailable:"),
	}
}

// measureIdle sums, over the stack's idle members: each holder's PSS (its private
// memory plus its share of the pages it maps with other holders), every tidepool
// shim's PSS, each member's memory cgroup kernel memory (memory.kmem.usage_in_bytes:
// slab, page tables, kernel stacks; the holder's user pages are in its PSS), and
// tidepoold's and containerd's RSS growth since before; the shared page cache (image files) is not
// counted. MemAvailable's drop is reported beside it.
func measureIdle(t testing.TB, s *stack.Stack, before baseline) idleCost {
	t.Helper()
	pids := map[string]string{}
	for _, line := range strings.Split(s.MustCtr(t, "task", "ls"), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] != "TASK" {
			pids[f[0]] = f[1]
		}
	}
	var c idleCost
	c.members = len(pids)
	for id, pid := range pids {
		c.holderPSS += procKiB("/proc/"+pid+"/smaps_rollup", "Pss:")
		if b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", s.C.Namespace, id, "memory.kmem.usage_in_bytes")); err == nil {
			v, _ := strconv.ParseFloat(strings.TrimSpace(string(b)), 64)
			c.kmem += v / 1024
		}
	}
	shims := tidepoolShims(t, s)
	c.shims = len(shims)
	for _, p := range shims {
		c.shimPSS += procKiB(fmt.Sprintf("/proc/%d/smaps_rollup", p.Pid), "Pss:")
	}
	c.daemon = daemonsRSS(s) - before.daemonKiB
	c.memAvailable = before.memAvailableKiB - procKiB("/proc/meminfo", "MemAvailable:")
	n := float64(max(c.members, 1))
	c.holderPSS, c.shimPSS, c.kmem, c.daemon, c.memAvailable = c.holderPSS/n, c.shimPSS/n, c.kmem/n, c.daemon/n, c.memAvailable/n
	return c
}

// drainDensePool restarts tidepoold with its pool replaced by one whose image does not
// exist: it destroys every member of the pool no longer configured. Then nothing of them may be left: no container, shim, cgroup,
// mount, runc state, bundle, or shim group state.
func drainDensePool(t testing.TB, s *stack.Stack, groups map[string]string) {
	t.Helper()
	cfgPath := filepath.Join(s.Dir, "tidepoold.toml")
	cfg, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	cfg = bytes.Replace(cfg, []byte(`name = "dense"`), []byte(`name = "drained"`), 1)
	cfg = bytes.Replace(cfg, []byte(`image = "`+imagebuild.BusyboxRef+`"`), []byte(`image = "tidepool.test/absent:latest"`), 1)
	if err := os.WriteFile(cfgPath, cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	// Killed, not stopped: a stop waits for every member's view; the new daemon
	// destroys members of unconfigured pools whatever the old one left.
	if err := s.Daemon.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
	// tidepoold destroys members one at a time: allow for a few seconds each.
	members := len(groups)
	deadline := time.Now().Add(time.Minute + time.Duration(members)*3*time.Second)
	for {
		ids := strings.Fields(s.MustCtr(t, "container", "ls", "-q"))
		if len(ids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d members left after the drain\n%s", len(ids), members, s.Daemon.LogTail(40))
		}
		time.Sleep(500 * time.Millisecond)
	}
	s.C.LeakCheck(t)
	seen := map[string]bool{}
	for _, g := range groups {
		if g == "" || seen[g] {
			continue
		}
		seen[g] = true
		if _, err := os.Stat(shim.GroupStatePath(filepath.Join(s.C.Dir, "s"), s.C.Address, s.C.Namespace, g)); !os.IsNotExist(err) {
			t.Errorf("state of shim group %s left behind (%v)", g, err)
		}
	}
}

// TestPoolDensity: 40 idle members in groups of 20 share one shim per group; claims
// from the grouped members behave as before (output, fork contents, exit status, a
// signal's death); the pool refills into the same shims; draining leaves nothing.
func TestPoolDensity(t *testing.T) {
	const n = 40
	s, before := densityStack(t, n, 20, "1s")
	root := s.Ingest(t, writeTree(t, appSource))
	waitPoolLong(t, s, "dense", n, 5*time.Minute)
	checkSharedShims(t, s)
	t.Log(measureIdle(t, s, before))

	client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	for i := 0; i < 5; i++ {
		var out, errOut bytes.Buffer
		exit, err := client.Run(context.Background(), &apiv1.RunStart{
			Pool: "dense", Fork: root, Args: []string{"sh", "-c", fmt.Sprintf("cat README.md && echo %d > n.txt && echo %d; exit %d", i, i, i)},
		}, localapi.RunStreams{Stdout: &out, Stderr: &errOut})
		if err != nil {
			t.Fatalf("claim %d: %v", i, err)
		}
		if want := appSource["README.md"] + fmt.Sprintf("%d\n", i); out.String() != want || exit.GetStatus() != int32(i) {
			t.Fatalf("claim %d: exit %d stdout %q stderr %q", i, exit.GetStatus(), out.String(), errOut.String())
		}
		if got := s.MustTidepool(t, "cat", exit.GetForkId(), "n.txt"); got != fmt.Sprintf("%d\n", i) {
			t.Fatalf("claim %d: fork holds %q", i, got)
		}
	}
	// A workload killed by a signal dies as a cold one would.
	sigs := make(chan os.Signal, 1)
	var out syncBuffer
	done := make(chan struct{})
	var exit *apiv1.RunExit
	go func() {
		defer close(done)
		exit, err = client.Run(context.Background(), &apiv1.RunStart{Pool: "dense", Args: []string{"sh", "-c", "echo up; sleep 1000"}},
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
	// Refilled into the groups' shims, not new ones.
	waitPoolLong(t, s, "dense", n, 2*time.Minute)
	checkSharedShims(t, s)
	drainDensePool(t, s, memberGroups(t, s))
}

// BenchmarkPoolDensity: memory per idle member with 200 members in shim groups of 100
// (the default), against one shim per member (40 members: 200 single shims would take
// ~4 GB). See measureIdle for what is counted. Goal: <= 5 MiB per member grouped.
func BenchmarkPoolDensity(b *testing.B) {
	run := func(n, groupSize int) idleCost {
		s, before := densityStack(b, n, groupSize, "5s")
		waitPoolLong(b, s, "dense", n, 15*time.Minute)
		time.Sleep(2 * time.Second)
		c := measureIdle(b, s, before)
		b.Log(c)
		if groupSize > 1 {
			msg, _ := shimReport(b, s)
			b.Log(msg)
		}
		groups := memberGroups(b, s)
		drainDensePool(b, s, groups)
		return c
	}
	// Minutes per measurement: measured once per test binary, whatever b.N (the
	// framework calls a benchmark with N=1 and again with -benchtime's N).
	densityOnce.Do(func() { densitySingle, densityGrouped = run(40, 1), run(200, 100) })
	single, grouped := densitySingle, densityGrouped
	if grouped.members == 0 || single.members == 0 {
		b.Fatal("no measurement (an earlier run failed)")
	}
	b.ReportMetric(grouped.total(), "grouped-KiB/member")
	b.ReportMetric(grouped.holderPSS, "grouped-holder-KiB/member")
	b.ReportMetric(grouped.shimPSS, "grouped-shim-KiB/member")
	b.ReportMetric(grouped.kmem, "grouped-kmem-KiB/member")
	b.ReportMetric(grouped.daemon, "grouped-daemon-KiB/member")
	b.ReportMetric(grouped.memAvailable, "grouped-memavail-drop-KiB/member")
	b.ReportMetric(float64(grouped.shims), "grouped-shims")
	b.ReportMetric(single.total(), "single-KiB/member")
	b.ReportMetric(single.shimPSS, "single-shim-KiB/member")
	b.ReportMetric(single.memAvailable, "single-memavail-drop-KiB/member")
	b.ReportMetric(single.total()/grouped.total(), "single/grouped-x")
}

var (
	densityOnce                   sync.Once
	densitySingle, densityGrouped idleCost
)

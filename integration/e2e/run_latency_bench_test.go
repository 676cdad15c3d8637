package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/shim"
)

// runFork makes a fork of root labelled label and returns its id.
func runFork(t testing.TB, s *stack.Stack, root, label string) string {
	t.Helper()
	return strings.TrimSpace(s.MustTidepool(t, "fork", root, "--label", label))
}

// forkRoot is the current root of a fork.
func forkRoot(t testing.TB, s *stack.Stack, id string) string {
	t.Helper()
	for _, f := range s.Forks(t) {
		if f.ID == id {
			return f.Root.String()
		}
	}
	t.Fatalf("fork %s not listed", id)
	return ""
}

var reportedFork = regexp.MustCompile(`tidepool: fork (\S+) at ([0-9a-f]{64}) \(member (\S+),`)

// TestRunResultAndDeferredTeardown: `tidepool run` reports the workload's exit status
// and the fork's new root, which holds exactly the workload's write, although the
// member is torn down only after the result went out; once the pool is back at
// target, nothing of the claimed members is left: containers, snapshots, views,
// mounts, cgroups, shims.
func TestRunResultAndDeferredTeardown(t *testing.T) {
	s := poolStack(t, 2, "")
	base := s.Ingest(t, writeTree(t, appSource))
	fork := runFork(t, s, base, "run-result")
	waitPool(t, s, "node", 2)

	var members []string
	run := func(wantCode int, args ...string) (stdout, root string) {
		t.Helper()
		out, errOut, code := tidepoolRun(t, s, "", append([]string{"--pool", "node", "--fork", fork, "--timings", "--"}, args...)...)
		if code != wantCode {
			t.Fatalf("tidepool run %v: exit %d, want %d\nstderr: %s", args, code, wantCode, errOut)
		}
		m := reportedFork.FindStringSubmatch(errOut)
		if m == nil || m[1] != fork {
			t.Fatalf("tidepool run %v: no new root of fork %s reported on stderr: %q", args, fork, errOut)
		}
		if !strings.Contains(errOut, "tidepool: timings (ms): main ") || !strings.Contains(errOut, " commit ") {
			t.Fatalf("tidepool run --timings: no steps on stderr: %q", errOut)
		}
		members = append(members, m[3])
		return out, m[2]
	}

	// A write and a non-zero status: both come back, and the new root is the base
	// plus exactly that file.
	out, root1 := run(7, "sh", "-c", "echo written > w.txt && cat README.md && exit 7")
	if out != appSource["README.md"] {
		t.Fatalf("stdout %q", out)
	}
	if d := s.MustTidepool(t, "diff", base, root1); d != "A w.txt\n" {
		t.Fatalf("diff base → new root = %q, want exactly the write", d)
	}
	if got := forkRoot(t, s, fork); got != root1 {
		t.Fatalf("fork %s is at %s, the run reported %s", fork, got, root1)
	}
	if got := s.MustTidepool(t, "cat", fork, "w.txt"); got != "written\n" {
		t.Fatalf("fork holds w.txt = %q", got)
	}
	// Nothing written: status 0 and the same root.
	if _, root2 := run(0, "true"); root2 != root1 {
		t.Fatalf("a run that wrote nothing moved the fork from %s to %s", root1, root2)
	}
	// A deletion and another status.
	_, root3 := run(3, "sh", "-c", "rm src/old.js && exit 3")
	if d := s.MustTidepool(t, "diff", root1, root3); d != "D src/old.js\n" {
		t.Fatalf("diff = %q, want exactly the deletion", d)
	}
	// Back to back, with no wait for the refill between them.
	for i := 0; i < 4; i++ {
		if _, root := run(0, "true"); root != root3 {
			t.Fatalf("run %d: root %s, want %s", i, root, root3)
		}
	}

	waitPool(t, s, "node", 2)
	waitFor(t, "only the 2 members left", func() string { return checkOnlyMembers(t, s, 2) })
	waitFor(t, "nothing left of the claimed members", func() string { return leftOfMembers(t, s, members) })
}

// leftOfMembers returns "" when no container, snapshot, mount, cgroup or shim names
// one of the members, else what does.
func leftOfMembers(t testing.TB, s *stack.Stack, members []string) string {
	var names []string
	names = append(names, strings.Fields(s.MustCtr(t, "container", "ls", "-q"))...)
	names = append(names, s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "ls"))
	for _, d := range []string{s.Root, s.C.Root, s.C.State} {
		m, _ := harness.MountsUnder(d)
		names = append(names, m...)
	}
	shims, err := harness.ShimProcesses(s.C.Address)
	if err != nil {
		t.Fatal(err)
	}
	// Members share shims: a shim started for a claimed member lives on while it is
	// the parent of another task (its group's).
	serving := harness.TaskParents(s.MustCtr(t, "tasks", "ls"))
	for _, p := range shims {
		if !serving[p.Pid] {
			names = append(names, strings.Join(p.Cmdline, " "))
		}
	}
	cgs, _ := harness.CgroupDirs("/" + s.C.Namespace)
	for _, cg := range cgs {
		ents, _ := os.ReadDir(cg)
		for _, e := range ents {
			names = append(names, filepath.Join(cg, e.Name()))
		}
	}
	for _, m := range members {
		for _, n := range names {
			if strings.Contains(n, m) {
				return fmt.Sprintf("member %s is still in %q", m, n)
			}
		}
	}
	return ""
}

// BenchmarkRunLatency: a warm `tidepool run --pool P --fork F -- true`, end to end
// (the CLI process's wall clock: start, dial, claim, bind, run, commit, exit), against
// a cold `ctr run --rm` of the same image with the same fork through the tidepool
// shim and snapshotter, p50 and p99 of each in the same run. Goal: warm p50 ≤ 40 ms.
// The median of each step `--timings` reports is logged beside, and the CLI's floor:
// `tidepool pools`, a process that starts, makes one call and exits.
func BenchmarkRunLatency(b *testing.B) {
	const target = 4
	s := poolStack(b, target, "")
	base := s.Ingest(b, writeTree(b, appSource))
	fork := runFork(b, s, base, "run-latency")
	waitPool(b, s, "node", target)
	tidepool := filepath.Join(s.Bin, "tidepool")

	runs := max(b.N, 20)
	var warm, cold, noop []time.Duration
	steps := map[string][]time.Duration{}
	var order []string
	b.ResetTimer()
	for i := 0; i < runs; i++ {
		waitIdle(b, s, "node", target)
		cmd := exec.Command(tidepool, "--root", s.Root, "run", "--pool", "node", "--fork", fork, "--quiet", "--", "true")
		start := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("warm run: %v\n%s", err, out)
		}
		warm = append(warm, time.Since(start))

		// The CLI's floor: a process that starts, makes one call and exits.
		start = time.Now()
		if out, err := exec.Command(tidepool, "--root", s.Root, "pools").CombinedOutput(); err != nil {
			b.Fatalf("tidepool pools: %v\n%s", err, out)
		}
		noop = append(noop, time.Since(start))

		// The same run with --timings, for the breakdown (not in the figures).
		waitIdle(b, s, "node", target)
		out, err := exec.Command(tidepool, "--root", s.Root, "run", "--pool", "node", "--fork", fork, "--quiet", "--timings", "--", "true").CombinedOutput()
		if err != nil {
			b.Fatalf("warm run with --timings: %v\n%s", err, out)
		}
		for _, st := range parseTimings(b, string(out)) {
			if _, ok := steps[st.name]; !ok {
				order = append(order, st.name)
			}
			steps[st.name] = append(steps[st.name], st.d)
		}

		c := exec.Command(ctrPath(b), append(append([]string{"--address", s.C.Address, "--namespace", s.C.Namespace, "run", "--rm", "--fifo-dir", s.C.FIFODir,
			"--runtime", shim.RuntimeName}, forkLabels(fork, "/app")...), imagebuild.NodeRef, fmt.Sprintf("cold-%d", i), "true")...)
		start = time.Now()
		if out, err := c.CombinedOutput(); err != nil {
			b.Fatalf("cold run: %v\n%s", err, out)
		}
		cold = append(cold, time.Since(start))
	}
	b.StopTimer()
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(percentile(warm, 0.5)), "warm-run-p50-ms")
	b.ReportMetric(ms(percentile(warm, 0.99)), "warm-run-p99-ms")
	b.ReportMetric(ms(percentile(noop, 0.5)), "cli-noop-p50-ms")
	b.ReportMetric(ms(percentile(cold, 0.5)), "cold-ctr-p50-ms")
	b.ReportMetric(ms(percentile(cold, 0.99)), "cold-ctr-p99-ms")
	b.ReportMetric(float64(percentile(cold, 0.5))/float64(percentile(warm, 0.5)), "cold/warm-p50-x")
	var line []string
	for _, name := range order {
		line = append(line, fmt.Sprintf("%s %.1f", name, ms(percentile(steps[name], 0.5))))
	}
	b.Logf("%d runs; median of each --timings step (ms): %s", runs, strings.Join(line, ", "))
}

type timedStep struct {
	name string
	d    time.Duration
}

var timingPair = regexp.MustCompile(`([a-z]+) ([0-9.]+)`)

// parseTimings reads the steps of a `--timings` line.
func parseTimings(t testing.TB, out string) []timedStep {
	t.Helper()
	_, line, ok := strings.Cut(out, "tidepool: timings (ms): ")
	if !ok {
		t.Fatalf("no timings in %q", out)
	}
	line, _, _ = strings.Cut(line, "\n")
	var steps []timedStep
	for _, m := range timingPair.FindAllStringSubmatch(line, -1) {
		v, _ := strconv.ParseFloat(m[2], 64)
		steps = append(steps, timedStep{m[1], time.Duration(v * float64(time.Millisecond))})
	}
	return steps
}

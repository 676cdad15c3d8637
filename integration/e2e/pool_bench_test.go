package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/shim"
)

const stampRef = "tidepool.test/node-stamp:latest"

// stampImage is the Node image plus /usr/local/bin/stamp, a static program that
// prints the time it started: the workload's first instruction.
func stampImage(b testing.TB) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), "stamp")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/stamp")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build stamp: %v\n%s", err, out)
	}
	spec, err := imagebuild.Node(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	spec.Layers = append(spec.Layers, imagebuild.Layer{imagebuild.HostFile("/usr/local/bin/stamp", bin)})
	return imagebuild.SpecArchive(b, spec).Path
}

func percentile(ds []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(float64(len(s)-1)*p)]
}

func stampOf(b testing.TB, out string) time.Time {
	b.Helper()
	ns, err := strconv.ParseInt(strings.TrimSpace(strings.SplitN(out, "\n", 2)[0]), 10, 64)
	if err != nil {
		b.Fatalf("no stamp in %q", out)
	}
	return time.Unix(0, ns)
}

// BenchmarkPoolClaim: claim to the workload's first instruction, warm (a pool member,
// through the local API and through `tidepool run`) against the same workload cold
// (`ctr run` through the tidepool shim and snapshotter, fork by label), p50 and p99;
// and the memory an idle member costs. Goals: warm p50 at least 5x faster than cold,
// and under 25 ms.
func BenchmarkPoolClaim(b *testing.B) {
	archive := stampImage(b)
	s := stack.Start(b, stack.Options{TidepooldConfig: func(s *stack.Stack) string {
		return s.PoolConfig(stack.Pool{Name: "stamp", Image: stampRef, Target: 4})
	}})
	s.C.ImportImage(b, archive, stampRef, "tidepool")
	root := s.Ingest(b, writeTree(b, appSource))
	waitPool(b, s, "stamp", 4)
	mem := idleMemory(b, s)

	client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	runs := max(b.N, 50)
	var warmAPI, warmCLI, cold []time.Duration
	b.ResetTimer()
	for i := 0; i < runs; i++ {
		waitIdle(b, s, "stamp", 4)
		var out bytes.Buffer
		start := time.Now()
		exit, err := client.Run(context.Background(), &apiv1.RunStart{Pool: "stamp", Fork: root, Args: []string{"stamp"}},
			localapi.RunStreams{Stdout: &out, Stderr: &out})
		if err != nil || exit.GetStatus() != 0 {
			b.Fatalf("warm run: %v %+v %q", err, exit, out.String())
		}
		warmAPI = append(warmAPI, stampOf(b, out.String()).Sub(start))

		waitIdle(b, s, "stamp", 4)
		start = time.Now()
		cmdOut, _, code := tidepoolRun(b, s, "", "--pool", "stamp", "--fork", root, "--quiet", "--", "stamp")
		if code != 0 {
			b.Fatalf("tidepool run exited %d", code)
		}
		warmCLI = append(warmCLI, stampOf(b, cmdOut).Sub(start))

		start = time.Now()
		c := exec.Command(ctrPath(b), append(append([]string{"--address", s.C.Address, "--namespace", s.C.Namespace, "run", "--rm", "--fifo-dir", s.C.FIFODir,
			"--runtime", shim.RuntimeName}, forkLabels(root, "/app")...), stampRef, fmt.Sprintf("cold-%d", i), "stamp")...)
		o, err := c.Output()
		if err != nil {
			b.Fatalf("cold run: %v", err)
		}
		cold = append(cold, stampOf(b, string(o)).Sub(start))
	}
	b.StopTimer()
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(percentile(warmAPI, 0.5)), "warm-api-p50-ms")
	b.ReportMetric(ms(percentile(warmAPI, 0.99)), "warm-api-p99-ms")
	b.ReportMetric(ms(percentile(warmCLI, 0.5)), "warm-cli-p50-ms")
	b.ReportMetric(ms(percentile(warmCLI, 0.99)), "warm-cli-p99-ms")
	b.ReportMetric(ms(percentile(cold, 0.5)), "cold-p50-ms")
	b.ReportMetric(ms(percentile(cold, 0.99)), "cold-p99-ms")
	b.ReportMetric(float64(percentile(cold, 0.5))/float64(percentile(warmCLI, 0.5)), "cold/warm-cli-p50-x")
	b.ReportMetric(float64(percentile(cold, 0.5))/float64(percentile(warmAPI, 0.5)), "cold/warm-api-p50-x")
	b.ReportMetric(mem.holderKB, "holder-rss-KB")
	b.ReportMetric(mem.shimKB, "shim-rss-KB")
	b.ReportMetric(mem.cgroupKB, "member-cgroup-KB")
}

func waitIdle(b testing.TB, s *stack.Stack, pool string, n int) {
	b.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for poolStatus(b, s, pool).idle < n {
		if time.Now().After(deadline) {
			b.Fatalf("pool %s never got back to %d idle", pool, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type memory struct{ holderKB, shimKB, cgroupKB float64 }

// idleMemory averages what idle members cost: the holder's RSS, their shim's RSS
// and the memory cgroup's usage (which also counts their share of page cache).
func idleMemory(b testing.TB, s *stack.Stack) memory {
	b.Helper()
	var m memory
	ids := strings.Fields(s.MustCtr(b, "container", "ls", "-q"))
	shims, err := harness.ShimProcesses(s.C.Address)
	if err != nil {
		b.Fatal(err)
	}
	for _, id := range ids {
		pid, _ := taskStatus(b, s, id)
		m.holderKB += rssKB(pid)
		for _, p := range shims {
			if strings.Contains(strings.Join(p.Cmdline, " "), "-id "+id) {
				m.shimKB += rssKB(strconv.Itoa(p.Pid))
			}
		}
		if usage, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", s.C.Namespace, id, "memory.usage_in_bytes")); err == nil {
			v, _ := strconv.ParseFloat(strings.TrimSpace(string(usage)), 64)
			m.cgroupKB += v / 1024
		}
	}
	n := float64(len(ids))
	return memory{m.holderKB / n, m.shimKB / n, m.cgroupKB / n}
}

func rssKB(pid string) float64 {
	f, err := os.Open("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return kb
		}
	}
	return 0
}

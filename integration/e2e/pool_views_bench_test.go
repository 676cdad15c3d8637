package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/localapi"
)

const stampBusyboxRef = "tidepool.test/busybox-stamp:latest"

// stampBusyboxImage is busybox plus /usr/local/bin/stamp (stampImage's program).
func stampBusyboxImage(b testing.TB) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), "stamp")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/stamp")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build stamp: %v\n%s", err, out)
	}
	spec, err := imagebuild.Busybox()
	if err != nil {
		b.Skip(err)
	}
	spec.Layers = append(spec.Layers, imagebuild.Layer{imagebuild.HostFile("/usr/local/bin/stamp", bin)})
	return imagebuild.SpecArchive(b, spec).Path
}

// loadAverage is /proc/loadavg's first three fields.
func loadAverage() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// claimPasses runs workload in a claimed member of pool with fork, once cold (caches
// dropped before the claim) and then warmPasses times warm in the same member, timed
// by busybox time inside it, as timedPasses does for a container started by ctr.
func claimPasses(b *testing.B, s *stack.Stack, pool, fork, workload string) (cold, warm time.Duration) {
	b.Helper()
	script := fmt.Sprintf("for n in 1 %d; do busybox time -f %%e sh -c 'i=0; while [ $i -lt '$n' ]; do %s; i=$((i+1)); done' 2>&1 >/dev/null | tail -1; done", warmPasses, workload)
	dropCaches(b)
	out, errOut, code := tidepoolRun(b, s, "", "--pool", pool, "--fork", fork, "--discard", "--quiet", "--", "sh", "-c", script)
	f := strings.Fields(out)
	if code != 0 || len(f) != 2 {
		b.Fatalf("claimed %s: exit %d, output %q, stderr %q", workload, code, out, errOut)
	}
	var d [2]time.Duration
	for i := range f {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			b.Fatalf("claimed %s: output %q", workload, out)
		}
		d[i] = time.Duration(v * float64(time.Second))
	}
	return d[0], d[1] / warmPasses
}

// newRoot commits one file named name over root with `tidepool commit`, outside any
// pool, and returns the new root.
func newRoot(b *testing.B, s *stack.Stack, root, name string) string {
	b.Helper()
	upper := b.TempDir()
	if err := os.WriteFile(filepath.Join(upper, name), []byte(name+"\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	return strings.TrimSpace(s.MustTidepool(b, "commit", "--base", root, "--upper", upper))
}

// BenchmarkPoolViews: what a claimed warm-pool member's workdir costs, with the fork
// bound late into a FUSE view in the member's rootfs (views.mode fuse: "fuse", and
// with views.no_open: "noopen") and with a kernel view mounted onto the member's slot
// at claim ("kernel": views.mode auto on a kernel that serves them), one pool of the
// busybox image with the Go source tree's fork at /src, tidepoold restarted between
// the three:
//   - claim latency, from the claim (the local API's Run) to the workload's first
//     instruction (stamp), p50 and p99: "same", on one root each time (the kernel
//     view's image built by the first claim, cached for the others); "next", on a
//     fork each claim advances (each claim's root is the one the previous claim
//     committed, whose image the pool builds after that claim: see prebuild); and
//     "never", on a new root committed outside the pool before each claim (`tidepool
//     commit` of one file: an image never built, its trees but one decoded before);
//   - reads in a claimed member, warm (the mean of warmPasses) and cold (caches
//     dropped before the claim): `grep -r` and a full read of /src, as ratios
//     against the same tree baked into the image on the overlayfs snapshotter, run
//     by ctr (BenchmarkKernelViewReads's baseline), each paired with a baseline run
//     right after it; and, for reference, in a container started by ctr with the
//     fork by label ("ctrkernel": a kernel view layered directly into its rootfs).
func BenchmarkPoolViews(b *testing.B) {
	const members = 2
	s := stack.Start(b, stack.Options{TidepooldConfig: func(s *stack.Stack) string {
		return s.PoolConfig(stack.Pool{Name: "bb", Image: stampBusyboxRef, Workdir: "/src", Target: members})
	}})
	s.C.ImportImage(b, stampBusyboxImage(b), stampBusyboxRef, "tidepool")
	s.C.ImportImage(b, bakedGoImage(b), bakedRef, "overlayfs")
	root := s.Ingest(b, filepath.Join(runtime.GOROOT(), "src"))
	cfgPath := filepath.Join(s.Dir, "tidepoold.toml")
	base, err := os.ReadFile(cfgPath)
	if err != nil {
		b.Fatal(err)
	}
	configs := []struct{ name, top string }{
		{"fuse", `views.mode = "fuse"`},
		{"noopen", "views.mode = \"fuse\"\nviews.no_open = true"},
		{"kernel", `views.mode = "auto"`},
	}
	workloads := []struct{ name, cmd string }{
		{"grep", "grep -r func /src > /dev/null"},
		{"read", "find /src -type f | xargs cat > /dev/null"},
	}
	claims := max(20/b.N, 10) // per iteration
	lat := map[string][]time.Duration{}
	// Each figure is paired with one of the baked image taken right after it, and
	// ratios are the median of the pairs': the shared machine's load drifts over the
	// minutes a run takes.
	type acc struct{ cold, warm, coldX, warmX []time.Duration }
	reads := map[string]*acc{}
	pair := func(k string, c, w, bc, bw time.Duration) {
		if reads[k] == nil {
			reads[k] = &acc{}
		}
		r := reads[k]
		r.cold, r.warm = append(r.cold, c), append(r.warm, w)
		// Ratios kept as durations (x1000) so that median applies.
		r.coldX, r.warmX = append(r.coldX, c*1000/bc), append(r.warmX, w*1000/bw)
	}
	baked := func(name string, i int, w string) (c, wm time.Duration) {
		return timedPasses(b, s, fmt.Sprintf("%s-baked-%d", name, i), []string{"--snapshotter", "overlayfs"}, bakedRef, w)
	}
	b.Logf("load average at start: %s", loadAverage())
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, cfg := range configs {
			// Killed, not stopped: a stop waits for FUSE views in members' rootfs.
			if err := os.WriteFile(cfgPath, append([]byte(cfg.top+"\n"), base...), 0o644); err != nil {
				b.Fatal(err)
			}
			if err := s.Daemon.Kill(); err != nil {
				b.Fatal(err)
			}
			if err := s.Daemon.Start(context.Background()); err != nil {
				b.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
			}
			waitPool(b, s, "bb", members)
			client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			fork := runFork(b, s, root, fmt.Sprintf("bench-%s-%d", cfg.name, i))
			for _, c := range []struct{ name, fork string }{{"same", root}, {"next", fork}, {"never", ""}} {
				k := cfg.name + "-" + c.name
				for j := 0; j < claims; j++ {
					target := c.fork
					if target == "" {
						target = newRoot(b, s, root, fmt.Sprintf("%s-%d-%d", k, i, j))
					}
					waitIdle(b, s, "bb", members)
					var out bytes.Buffer
					start := time.Now()
					exit, err := client.Run(context.Background(), &apiv1.RunStart{Pool: "bb", Fork: target,
						Args: []string{"sh", "-c", "/usr/local/bin/stamp && echo " + strconv.Itoa(j) + " > /src/.claim"}},
						localapi.RunStreams{Stdout: &out, Stderr: &out})
					if err != nil || exit.GetStatus() != 0 {
						b.Fatalf("%s claim %d: %v %+v %q", k, j, err, exit, out.String())
					}
					lat[k] = append(lat[k], stampOf(b, out.String()).Sub(start))
				}
			}
			client.Close()
			for _, w := range workloads {
				waitIdle(b, s, "bb", members)
				c, wm := claimPasses(b, s, "bb", root, w.cmd)
				bc, bw := baked(w.name+"-"+cfg.name, i, w.cmd)
				pair(w.name+"-"+cfg.name, c, wm, bc, bw)
				pair(w.name+"-baked", bc, bw, bc, bw)
				if cfg.name == "kernel" {
					// The same tree in a container started cold by ctr with the fork
					// by label: a kernel view layered directly into its rootfs.
					c, wm := timedPasses(b, s, fmt.Sprintf("%s-ctr-%d", w.name, i), forkLabels(root, "/src"), stampBusyboxRef, w.cmd)
					bc, bw := baked(w.name+"-ctr", i, w.cmd)
					pair(w.name+"-ctrkernel", c, wm, bc, bw)
					pair(w.name+"-baked", bc, bw, bc, bw)
				}
			}
		}
	}
	b.StopTimer()
	b.Logf("load average at end: %s", loadAverage())
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	for _, cfg := range configs {
		for _, c := range []string{"same", "next", "never"} {
			k := cfg.name + "-" + c
			b.ReportMetric(ms(percentile(lat[k], 0.5)), "claim-"+k+"-p50-ms")
			b.ReportMetric(ms(percentile(lat[k], 0.99)), "claim-"+k+"-p99-ms")
		}
	}
	// The kernel view's first claim on the tree is also the daemon's first scan of it.
	b.ReportMetric(ms(lat["kernel-same"][0]), "claim-kernel-first-ms")
	for _, w := range workloads {
		base := reads[w.name+"-baked"]
		b.ReportMetric(ms(median(base.warm)), w.name+"-warm-baked-ms")
		b.ReportMetric(ms(median(base.cold)), w.name+"-cold-baked-ms")
		for _, name := range []string{"fuse", "noopen", "kernel", "ctrkernel"} {
			r := reads[w.name+"-"+name]
			b.ReportMetric(ms(median(r.warm)), w.name+"-warm-"+name+"-ms")
			b.ReportMetric(float64(median(r.warmX))/1000, w.name+"-warm-"+name+"-x")
			b.ReportMetric(ms(median(r.cold)), w.name+"-cold-"+name+"-ms")
			b.ReportMetric(float64(median(r.coldX))/1000, w.name+"-cold-"+name+"-x")
		}
	}
}

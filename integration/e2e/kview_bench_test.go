package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
)

const bakedRef = "tidepool.test/busybox-gosrc:latest"

// dropCaches empties the page, dentry and inode caches, for cold reads.
func dropCaches(b *testing.B) {
	b.Helper()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200); err != nil {
		b.Fatal(err)
	}
}

// warmPasses is how many warm passes one warm figure averages: busybox time counts
// in 10 ms steps, a tenth of a warm pass.
const warmPasses = 5

// timedPasses runs a container that times workload with busybox time, once cold and
// then warmPasses times warm, and returns the cold pass and the warm passes' mean.
func timedPasses(b *testing.B, s *stack.Stack, id string, flags []string, image, workload string) (cold, warm time.Duration) {
	b.Helper()
	script := fmt.Sprintf("for n in 1 %d; do busybox time -f %%e sh -c 'i=0; while [ $i -lt '$n' ]; do %s; i=$((i+1)); done' 2>&1 >/dev/null | tail -1; done", warmPasses, workload)
	dropCaches(b)
	out := runRm(b, s, id, flags, image, "sh", "-c", script)
	f := strings.Fields(out)
	if len(f) != 2 {
		b.Fatalf("%s: output %q", id, out)
	}
	var d [2]time.Duration
	for i := range f {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			b.Fatalf("%s: output %q", id, out)
		}
		d[i] = time.Duration(v * float64(time.Second))
	}
	return d[0], d[1] / warmPasses
}

// BenchmarkKernelViewReads: in a container, `grep -r` and a full read of the Go source
// tree at the workdir, from a fork (a kernel view under views.mode auto) layered both
// ways (views.layering direct: the EROFS image in the container's overlay; nested: the
// view's own overlay as a layer; tidepoold restarted between them) against the same
// tree baked into the image on the overlayfs snapshotter. Cold = caches dropped first,
// warm = the same workload again in the same container (the mean of warmPasses).
// Goals: warm <= 1.15x, cold <= 1.05x.
func BenchmarkKernelViewReads(b *testing.B) {
	if os.Getenv("TIDEPOOL_VIEWS_LAYERING") != "" {
		b.Skip("measures both layerings itself: unset TIDEPOOL_VIEWS_LAYERING")
	}
	s := stack.Start(b, stack.Options{})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool")
	src := filepath.Join(runtime.GOROOT(), "src")
	baked := bakedGoImage(b)
	s.C.ImportImage(b, baked, bakedRef, "overlayfs")
	root := s.Ingest(b, src)
	workloads := map[string]string{
		"grep": "grep -r func /src > /dev/null",
		"read": "find /src -type f | xargs cat > /dev/null",
	}
	layerings := []string{"direct", "nested"}
	type acc struct{ cold, warm []time.Duration }
	res := map[string]*acc{}
	add := func(k string, c, w time.Duration) {
		if res[k] == nil {
			res[k] = &acc{}
		}
		res[k].cold, res[k].warm = append(res[k].cold, c), append(res[k].warm, w)
	}
	for i := 0; i < b.N; i++ {
		for _, l := range layerings {
			s.RestartDaemonWith(b, fmt.Sprintf("views.layering = %q", l))
			for name, w := range workloads {
				k := name + "-" + l
				c, wm := timedPasses(b, s, fmt.Sprintf("%s-%d", k, i), forkLabels(root, "/src"), imagebuild.BusyboxRef, w)
				add(k, c, wm)
			}
		}
		for name, w := range workloads {
			k := name + "-baked"
			c, wm := timedPasses(b, s, fmt.Sprintf("%s-%d", k, i), []string{"--snapshotter", "overlayfs"}, bakedRef, w)
			add(k, c, wm)
		}
	}
	b.StopTimer()
	for name := range workloads {
		base := res[name+"-baked"]
		b.ReportMetric(float64(median(base.warm).Milliseconds()), name+"-warm-baked-ms")
		b.ReportMetric(float64(median(base.cold).Milliseconds()), name+"-cold-baked-ms")
		for _, l := range layerings {
			f := res[name+"-"+l]
			b.ReportMetric(float64(median(f.warm).Milliseconds()), name+"-warm-"+l+"-ms")
			b.ReportMetric(float64(median(f.warm))/float64(median(base.warm)), name+"-warm-"+l+"-x")
			b.ReportMetric(float64(median(f.cold).Milliseconds()), name+"-cold-"+l+"-ms")
			b.ReportMetric(float64(median(f.cold))/float64(median(base.cold)), name+"-cold-"+l+"-x")
		}
	}
}

// bakedGoImage is busybox with the Go source tree copied into /src.
func bakedGoImage(b *testing.B) string {
	b.Helper()
	spec, err := imagebuild.Busybox()
	if err != nil {
		b.Skip(err)
	}
	spec.Layers = append(spec.Layers, imagebuild.Layer{imagebuild.HostFile("/src", filepath.Join(runtime.GOROOT(), "src"))})
	return imagebuild.SpecArchive(b, spec).Path
}

// BenchmarkRunWithNewKernelView: `ctr run --rm` with a fork of the Go source tree whose
// kernel view image was never built (each run asks for a new owner, so a new image;
// the first run's is also the first scan of the tree),
// and again on a tree whose image is cached, against the overlayfs snapshotter
// without a fork. Goal: never-built within 1.2x.
func BenchmarkRunWithNewKernelView(b *testing.B) {
	s := stack.Start(b, stack.Options{})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool", "overlayfs")
	root := s.Ingest(b, filepath.Join(runtime.GOROOT(), "src"))
	var fresh, cached, base []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		owner := fmt.Sprintf("%d:%d", 2000+i, 2000+i)
		_, t := timeToFirstByte(b, s, append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir},
			forkLabels(root, "/src", binding.LabelOwner+"="+owner)...), imagebuild.BusyboxRef, fmt.Sprintf("new-%d", i), "head", "-c", "64", "/src/go/build/build.go")...)
		fresh = append(fresh, t)
		_, t = timeToFirstByte(b, s, append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir},
			forkLabels(root, "/src", binding.LabelOwner+"="+owner)...), imagebuild.BusyboxRef, fmt.Sprintf("again-%d", i), "head", "-c", "64", "/src/go/build/build.go")...)
		cached = append(cached, t)
		_, t = timeToFirstByte(b, s, "run", "--rm", "--fifo-dir", s.C.FIFODir, "--snapshotter", "overlayfs",
			imagebuild.BusyboxRef, fmt.Sprintf("base-%d", i), "head", "-c", "64", "/etc/passwd")
		base = append(base, t)
	}
	b.StopTimer()
	// The first new view is the daemon's first scan of the tree; later ones (new
	// owners of the same root) take its decoded trees from the build memo, as views
	// of a commit's new root would.
	b.ReportMetric(float64(fresh[0].Microseconds())/1000, "first-new-view-run-ms")
	b.ReportMetric(float64(median(fresh).Microseconds())/1000, "new-view-run-ms")
	b.ReportMetric(float64(median(cached).Microseconds())/1000, "cached-view-run-ms")
	b.ReportMetric(float64(median(base).Microseconds())/1000, "overlayfs-run-ms")
	b.ReportMetric(float64(median(fresh))/float64(median(base)), "new-view-x-vs-overlayfs")
	b.ReportMetric(float64(median(cached))/float64(median(base)), "cached-view-x-vs-overlayfs")
}

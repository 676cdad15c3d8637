package e2e

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
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
// view's own overlay as a layer), and layered directly without the cold read-ahead
// (noahead: views.cold_read_ahead_mb = 0, what the kernel path costs alone), against
// the same tree baked into the image on the overlayfs snapshotter; tidepoold is
// restarted to switch. Cold = caches dropped first, so that the view is mounted onto
// cold caches and (but for noahead) reads its files ahead; warm = the same workload
// again in the same container (the mean of warmPasses). The arms of a workload run
// back to back, in an order that rotates every round, so that a machine whose load
// drifts weighs on each arm alike. Goals: warm <= 1.15x, cold <= 1.05x.
func BenchmarkKernelViewReads(b *testing.B) {
	if os.Getenv("TIDEPOOL_VIEWS_LAYERING") != "" {
		b.Skip("measures both layerings itself: unset TIDEPOOL_VIEWS_LAYERING")
	}
	s := stack.Start(b, stack.Options{Metrics: true})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool")
	src := filepath.Join(runtime.GOROOT(), "src")
	baked := bakedGoImage(b)
	s.C.ImportImage(b, baked, bakedRef, "overlayfs")
	root := s.Ingest(b, src)
	workloads := []struct{ name, cmd string }{
		{"read", "find /src -type f | xargs cat > /dev/null"},
		{"grep", "grep -r func /src > /dev/null"},
	}
	arms := []string{"direct", "nested", "noahead", "baked"}
	configs := map[string]string{
		"direct":  `views.layering = "direct"`,
		"nested":  `views.layering = "nested"`,
		"noahead": "views.layering = \"direct\"\nviews.cold_read_ahead_mb = 0",
	}
	type acc struct{ cold, warm []time.Duration }
	res := map[string]*acc{}
	add := func(k string, c, w time.Duration) {
		if res[k] == nil {
			res[k] = &acc{}
		}
		res[k].cold, res[k].warm = append(res[k].cold, c), append(res[k].warm, w)
	}
	layering := "direct" // tidepoold's default
	aheads := 0.0
	for i := 0; i < b.N; i++ {
		for _, w := range workloads {
			for j := range arms {
				arm := arms[(i+j)%len(arms)]
				k := w.name + "-" + arm
				id := fmt.Sprintf("%s-%d", k, i)
				var c, wm time.Duration
				switch {
				case arm == "baked":
					c, wm = timedPasses(b, s, id, []string{"--snapshotter", "overlayfs"}, bakedRef, w.cmd)
				default:
					if arm != layering {
						// A removed container's view goes when containerd collects its
						// snapshot; a restart before then would leave it mounted.
						waitViewsReleased(b, s)
						aheads += s.Metric(b, "tidepool_views_cold_read_aheads_total")
						s.RestartDaemonWith(b, configs[arm])
						layering = arm
					}
					c, wm = timedPasses(b, s, id, forkLabels(root, "/src"), imagebuild.BusyboxRef, w.cmd)
				}
				add(k, c, wm)
			}
		}
	}
	b.StopTimer()
	waitViewsReleased(b, s)
	// Each cold pass of direct and nested mounted a view onto cold caches.
	b.ReportMetric(aheads+s.Metric(b, "tidepool_views_cold_read_aheads_total"), "cold-read-aheads")
	for _, w := range workloads {
		base := res[w.name+"-baked"]
		b.ReportMetric(float64(median(base.warm).Milliseconds()), w.name+"-warm-baked-ms")
		b.ReportMetric(float64(median(base.cold).Milliseconds()), w.name+"-cold-baked-ms")
		for _, l := range arms[:3] {
			f := res[w.name+"-"+l]
			b.ReportMetric(float64(median(f.warm).Milliseconds()), w.name+"-warm-"+l+"-ms")
			b.ReportMetric(float64(median(f.warm))/float64(median(base.warm)), w.name+"-warm-"+l+"-x")
			b.ReportMetric(float64(median(f.cold).Milliseconds()), w.name+"-cold-"+l+"-ms")
			b.ReportMetric(float64(median(f.cold))/float64(median(base.cold)), w.name+"-cold-"+l+"-x")
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
// kernel view was never built, against the overlayfs snapshotter without a fork,
// interleaved. Each round restarts tidepoold first and warms it and containerd up
// with one run on a view built before the restart and one overlayfs run; the round
// then waits (untimed) for tidepoold's start-up work (the trees of the roots its
// images showed last decoded, the views of roots ingested while it was down
// prepared), as any container after the first second of a daemon's life would find
// it done, and runs: unseen, a tree tidepoold never decoded (the Go tree with a file
// added to every directory, so that every tree object is new, ingested by the CLI
// while tidepoold was down and its arrival record removed, as for a tree a tool that
// tells no tidepoold put in the store, such as LunarFS: a new image from a full scan,
// every tree object read and decoded); offline, another such tree, its arrival record
// kept (as `tidepool ingest` leaves it while no tidepoold runs), run at the agent's
// workdir and owner (a recent view's: its image was built at start-up); first, the Go tree at a workdir it was never
// mounted at (a new image, its trees decoded at start-up); shared, another new
// workdir (a new image, the trees decoded, as for a commit's new root); derived,
// first's workdir for a new owner (the image derived from first's, its owner
// rewritten); cached, that owner again (the image is cached); committed, an agent's
// next turn: a fork whose previous container wrote a file, so that its root is one
// no view ever showed, the image built in the background when the commit landed
// (arrivals; untimed: the round waits for that build, as a turn that starts a moment
// after the last one ended would not); base, overlayfs. Goal: a tree never mounted
// before within 1.2x of base. Each arm also reports its excess over base in
// milliseconds (medianExcess): a fixed cost is a smaller ratio of a slower start, so
// the ratio alone moves with how fast the host starts containers.
func BenchmarkRunWithNewKernelView(b *testing.B) {
	s := stack.Start(b, stack.Options{Metrics: true})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool", "overlayfs")
	src := filepath.Join(runtime.GOROOT(), "src")
	root := s.Ingest(b, src)
	run := func(name, workdir string, flags ...string) time.Duration {
		file := workdir + "/go/build/build.go"
		if len(flags) == 0 {
			flags, file = []string{"--snapshotter", "overlayfs"}, "/etc/passwd"
		}
		args := append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, flags...), imagebuild.BusyboxRef, name, "head", "-c", "64", file)
		_, t := timeToFirstByte(b, s, args...)
		return t
	}
	viewOf := func(root, workdir string, owner int) []string {
		return forkLabels(root, workdir, fmt.Sprintf("%s=%d:%d", binding.LabelOwner, owner, owner))
	}
	view := func(workdir string, owner int) []string { return viewOf(root, workdir, owner) }
	run("built-before", "/src", view("/src", 1999)...)
	agent := strings.TrimSpace(s.MustTidepool(b, "fork", root, "--label", "agent"))
	agentOwner := binding.LabelOwner + "=2000:2000"
	agentView := forkLabels(agent, "/agent", agentOwner)
	// The agent's view is a recent one when the first round restarts tidepoold.
	run("agent-before", "/agent", agentView...)
	images := func() float64 {
		return s.Metric(b, "tidepool_views_image_builds_total") + s.Metric(b, "tidepool_views_image_derived_total")
	}
	var unseen, offline, first, shared, derived, cached, committed, base []time.Duration
	var unseenTrees, unseenBuild []float64
	var offlineBuilt float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		// unseen's and offline's trees are ingested while tidepoold is down; unseen's
		// record is removed, so that nobody tells tidepoold of it.
		waitViewsReleased(b, s)
		if err := s.Daemon.Stop(); err != nil {
			b.Fatal(err)
		}
		fresh := s.Ingest(b, saltedTree(b, src, fmt.Sprint(i)))
		if err := os.Remove(filepath.Join(s.Root, "arrivals", fresh)); err != nil {
			b.Fatal(err)
		}
		recorded := s.Ingest(b, saltedTree(b, src, fmt.Sprintf("offline-%d", i)))
		if err := s.Daemon.Start(context.Background()); err != nil {
			b.Fatalf("start tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
		}
		run(fmt.Sprintf("warm-view-%d", i), "/src", view("/src", 1999)...)
		run(fmt.Sprintf("warm-base-%d", i), "")
		for deadline := time.Now().Add(time.Minute); s.Metric(b, "tidepool_views_trees_warmed_total") == 0 ||
			s.Metric(b, "tidepool_snapshotter_roots_arrived_total", `via="spool"`) == 0 ||
			s.Metric(b, "tidepool_snapshotter_views_preparing") > 0; {
			if time.Now().After(deadline) {
				b.Fatal("tidepoold's start-up work (trees of recent views decoded, the recorded root's views prepared) not done in a minute")
			}
			time.Sleep(20 * time.Millisecond)
		}
		read0 := s.Metric(b, "tidepool_views_image_trees_read_total")
		build0 := s.Metric(b, "tidepool_views_image_build_seconds_total")
		b.StartTimer()
		unseen = append(unseen, run(fmt.Sprintf("unseen-%d", i), "/fresh", viewOf(fresh, "/fresh", 2000)...))
		b.StopTimer()
		unseenTrees = append(unseenTrees, s.Metric(b, "tidepool_views_image_trees_read_total")-read0)
		unseenBuild = append(unseenBuild, 1000*(s.Metric(b, "tidepool_views_image_build_seconds_total")-build0))
		built := images()
		b.StartTimer()
		offline = append(offline, run(fmt.Sprintf("offline-%d", i), "/agent", forkLabels(recorded, "/agent", agentOwner)...))
		b.StopTimer()
		offlineBuilt += images() - built
		b.StartTimer()
		wd, wd2 := fmt.Sprintf("/src-%d", i), fmt.Sprintf("/src-%d-b", i)
		first = append(first, run(fmt.Sprintf("first-%d", i), wd, view(wd, 2000)...))
		b.StopTimer()
		// The agent's turn (after first, whose build would otherwise find the trees
		// of this turn's decoded by its builds): its commit is the fork's next root,
		// whose image is built when the commit lands. Every turn finds its own view
		// built: by agent-before, or when the turn before committed.
		want := images() + 1
		runRm(b, s, fmt.Sprintf("turn-%d", i), agentView, imagebuild.BusyboxRef, "sh", "-c", fmt.Sprintf("echo %d > /agent/turn", i))
		for deadline := time.Now().Add(time.Minute); images() < want && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		if got := images(); got < want {
			b.Fatalf("turn %d: %v images built, want %v: the commit's root was not prepared", i, got, want)
		}
		b.StartTimer()
		shared = append(shared, run(fmt.Sprintf("shared-%d", i), wd2, view(wd2, 2000)...))
		derived = append(derived, run(fmt.Sprintf("derived-%d", i), wd, view(wd, 3000+i)...))
		cached = append(cached, run(fmt.Sprintf("cached-%d", i), wd, view(wd, 3000+i)...))
		committed = append(committed, run(fmt.Sprintf("committed-%d", i), "/agent", agentView...))
		base = append(base, run(fmt.Sprintf("base-%d", i), ""))
	}
	b.StopTimer()
	for _, m := range []struct {
		name string
		ds   []time.Duration
	}{{"unseen", unseen}, {"offline", offline}, {"first", first}, {"shared", shared}, {"derived", derived}, {"cached", cached}, {"committed", committed}} {
		b.ReportMetric(float64(median(m.ds).Microseconds())/1000, m.name+"-view-run-ms")
		b.ReportMetric(float64(median(m.ds))/float64(median(base)), m.name+"-view-x-vs-overlayfs")
		b.ReportMetric(float64(medianExcess(m.ds, base).Microseconds())/1000, m.name+"-view-excess-ms")
	}
	b.ReportMetric(float64(median(base).Microseconds())/1000, "overlayfs-run-ms")
	// What makes unseen what it says: its build read every tree object.
	sort.Float64s(unseenTrees)
	b.ReportMetric(unseenTrees[0], "unseen-trees-read-min")
	// How much of unseen's run its image build took, in tidepoold (the median).
	sort.Float64s(unseenBuild)
	b.ReportMetric(unseenBuild[len(unseenBuild)/2], "unseen-build-ms")
	// What makes offline what it says: its image was built before it ran (0).
	b.ReportMetric(offlineBuilt, "offline-images-built")
	// No view here is mounted onto cold caches: nothing may have been read ahead.
	b.ReportMetric(s.Metric(b, "tidepool_views_cold_read_aheads_total"), "cold-read-aheads")
}

// medianExcess is the median over rounds of how much longer a view's run took than
// the same round's overlayfs run: what a view adds to a container's start, in
// milliseconds: unlike the ratio, it does not shrink when the host starts containers
// more slowly. A round's runs are seconds apart, so pairing them also takes out what
// drifts from round to round.
func medianExcess(view, base []time.Duration) time.Duration {
	d := make([]time.Duration, len(view))
	for i := range view {
		d[i] = view[i] - base[i]
	}
	return median(d)
}

// saltedTree is a copy of dir (files hard-linked where the filesystem allows) with a
// file naming salt added to every directory, so that none of its tree objects is one
// of dir's.
func saltedTree(b *testing.B, dir, salt string) string {
	b.Helper()
	out := filepath.Join(b.TempDir(), "tree")
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		dst := filepath.Join(out, rel)
		switch {
		case d.IsDir():
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(dst, ".salt"), []byte(salt+"\n"), 0o644)
		case d.Type().IsRegular():
			if os.Link(p, dst) == nil {
				return nil
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			return os.WriteFile(dst, data, info.Mode().Perm())
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(target, dst)
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return out
}

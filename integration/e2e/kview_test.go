package e2e

import (
	"context"
	"crypto/md5"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/kview"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// requireKernelViews skips unless this run serves views with the kernel.
func requireKernelViews(t *testing.T) {
	t.Helper()
	if m := os.Getenv("TIDEPOOL_VIEWS_MODE"); m == "fuse" {
		t.Skip("views.mode = fuse: FUSE views are served by tidepoold and die with it")
	}
	if err := kview.Probe(t.TempDir()); err != nil {
		t.Skip(err)
	}
}

// catSum is the md5 (hex) of the files' contents concatenated in path order: what
// `find | sort | xargs cat | md5sum` prints in a container that has them.
func catSum(files map[string]string) string {
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	h := md5.New()
	for _, p := range paths {
		h.Write([]byte(files[p]))
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// TestContainersSurviveDaemonKill: containers on forks of one tree read their whole
// fork and write files in a loop while tidepoold is SIGKILLed and restarted twice.
// Kernel views need no process, so no read or write may fail; the restarted daemon
// adopts the views, each container's commit on removal equals re-ingesting its
// merged workdir, and nothing is left mounted.
func TestContainersSurviveDaemonKill(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	files := map[string]string{}
	var all []string
	for i := range 200 {
		p := fmt.Sprintf("src/pkg%02d/file%03d.txt", i%10, i)
		files[p] = strings.Repeat(fmt.Sprintf("line %d of %s\n", i, p), 1+i%50)
		all = append(all, p)
	}
	sort.Strings(all)
	sum := catSum(files)
	root := s.Ingest(t, writeTree(t, files))

	const n, rounds = 20, 30
	var wg sync.WaitGroup
	outs := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("survive-%02d", i)
			// Every round: read the whole original fork (checksum in name order) and
			// write a file; any failure ends the loop with a non-zero status.
			script := fmt.Sprintf(`set -e
mkdir /app/out
touch /app/started
for r in $(seq 1 %d); do
  got=$(find /app/src -type f | sort | xargs cat | md5sum | cut -d' ' -f1)
  [ "$got" = %s ] || { echo "round $r: checksum $got"; exit 1; }
  echo "round $r" > /app/out/$r
  sleep 0.3
done
echo ok`, rounds, sum)
			args := append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/app")...)
			// Twenty containers reading in a loop on a loaded 2-core machine can take
			// longer than Ctr's default bound.
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
			defer cancel()
			outs[i], errs[i] = s.C.CtrContext(ctx, "", append(args, imagebuild.BusyboxRef, id, "sh", "-c", script)...)
		}()
	}

	// Wait until every container runs, then crash and restart tidepoold twice.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		out, _ := s.Ctr("task", "ls")
		if strings.Count(out, "RUNNING") == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("containers did not all start:\n%s", out)
		}
		if finished(&wg) {
			t.Fatalf("every container ended before all ran:\noutputs %q\nerrors %v", outs, errs)
		}
		time.Sleep(200 * time.Millisecond)
	}
	views, err := kview.List(filepath.Join(s.Root, "views"))
	if err != nil || len(views) != n {
		t.Fatalf("%d kernel views under the root (%v), want %d", len(views), err, n)
	}
	for range 2 {
		time.Sleep(time.Second)
		if err := s.Daemon.Kill(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
		if err := s.Daemon.Start(context.Background()); err != nil {
			t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
		}
	}
	if after, _ := kview.List(filepath.Join(s.Root, "views")); len(after) != n {
		t.Errorf("%d kernel views after the restarts, want the same %d adopted", len(after), n)
	}
	wg.Wait()

	for i := range n {
		id := fmt.Sprintf("survive-%02d", i)
		// The exit status says the loop ran every round (set -e; any failed read
		// exits 1); the output, which ctr can lose the end of under this load, only
		// explains a failure.
		if errs[i] != nil {
			t.Errorf("%s: %v, output %q", id, errs[i], outs[i])
			continue
		}
		// The merged workdir at the end was the fork plus started and out/1..rounds.
		f := forkOfContainer(t, s, id, root)
		expect := map[string]string{"started": ""}
		for p, c := range files {
			expect[p] = c
		}
		for r := 1; r <= rounds; r++ {
			expect[fmt.Sprintf("out/%d", r)] = fmt.Sprintf("round %d\n", r)
		}
		if re := s.Ingest(t, writeTree(t, expect)); re != f.Root.String() {
			t.Errorf("%s: commit %s, re-ingest of the merged workdir %s", id, f.Root, re)
		}
	}
	if left, _ := kview.List(filepath.Join(s.Root, "views")); len(left) != 0 {
		t.Errorf("kernel views left after every container went: %v", left)
	}
	if left, _ := harness.MountsUnder(s.Root); len(left) != 0 {
		t.Errorf("mounts left under the root: %v", left)
	}
	s.C.LeakCheck(t)
}

// finished reports whether wg is done (waiting at most 10 ms).
func finished(wg *sync.WaitGroup) bool {
	c := make(chan struct{})
	go func() { wg.Wait(); close(c) }()
	select {
	case <-c:
		return true
	case <-time.After(10 * time.Millisecond):
		return false
	}
}

// TestKernelViewForAnotherOwner: a tree's view for a second owner is derived from the
// image of the first (also by a restarted tidepoold, from the images the previous one
// left), and containers see the tree owned by their own owner; an owner needing
// extended inodes gets an image built from a scan.
func TestKernelViewForAnotherOwner(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, map[string]string{"src/main.go": "package main\n", "README.md": "hi\n"}))
	script := "stat -c '%u:%g' /app /app/src /app/src/main.go && cat /app/README.md && echo new > /app/src/new.go && stat -c '%u:%g' /app/src/new.go"
	run := func(id string, uid int) {
		t.Helper()
		want := strings.Repeat(fmt.Sprintf("%d:%d\n", uid, uid), 3) + "hi\n0:0\n"
		owner := fmt.Sprintf("%s=%d:%d", binding.LabelOwner, uid, uid)
		// Discarded, so that no commit builds the image of a next root (arrivals).
		if out := runRm(t, s, id, forkLabels(root, "/app", owner, binding.LabelDiscard+"=true"), imagebuild.BusyboxRef, "sh", "-c", script); out != want {
			t.Fatalf("%s (owner %d): printed %q, want %q", id, uid, out, want)
		}
	}
	builds := func() (float64, float64) {
		return s.Metric(t, "tidepool_views_image_builds_total"), s.Metric(t, "tidepool_views_image_derived_total")
	}
	run("owner-1000", 1000)
	run("owner-2000", 2000)
	if b, d := builds(); b != 1 || d != 1 {
		t.Fatalf("%v images built and %v derived, want 1 and 1", b, d)
	}
	waitViewsReleased(t, s)
	s.RestartDaemon(t)
	run("owner-3000", 3000)
	run("owner-70000", 70000)
	if b, d := builds(); b != 1 || d != 1 {
		t.Fatalf("after a restart: %v images built and %v derived, want 1 (owner 70000: extended inodes) and 1 (owner 3000)", b, d)
	}
	waitViewsReleased(t, s)
	s.C.LeakCheck(t)
}

// TestKernelViewColdReadAhead: a container whose kernel view is mounted onto cold
// caches (dropped first, as after a reboot) reads its files whole while tidepoold reads
// their objects ahead, once, all of them (within views.cold_read_ahead_mb); a view
// mounted onto warm caches reads nothing ahead, and views.cold_read_ahead_mb = 0
// turns it off.
func TestKernelViewColdReadAhead(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	files := map[string]string{}
	size := 0
	for i := range 40 {
		p := fmt.Sprintf("src/d%d/f%02d.txt", i%4, i)
		files[p] = strings.Repeat(fmt.Sprintf("%d ", i), 8000+i*100)
		size += len(files[p])
	}
	want := catSum(files)
	root := s.Ingest(t, writeTree(t, files))
	script := "cd /app && find src -type f | sort | xargs cat | md5sum | cut -d' ' -f1"
	run := func(id string) {
		t.Helper()
		if out := strings.TrimSpace(runRm(t, s, id, forkLabels(root, "/app", binding.LabelDiscard+"=true"), imagebuild.BusyboxRef, "sh", "-c", script)); out != want {
			t.Fatalf("%s: the files read %s, want %s", id, out, want)
		}
	}
	dropCaches := func() {
		t.Helper()
		if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200); err != nil {
			t.Fatal(err)
		}
	}
	aheads := func() (float64, float64) {
		return s.Metric(t, "tidepool_views_cold_read_aheads_total"), s.Metric(t, "tidepool_views_cold_read_ahead_bytes_total")
	}
	run("warm-build") // builds the image: cached, so warm
	if n, _ := aheads(); n != 0 {
		t.Fatalf("a view mounted right after its image was built read ahead %v times", n)
	}
	dropCaches()
	run("cold")
	deadline := time.Now().Add(30 * time.Second)
	n, bytes := aheads()
	for n != 1 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		n, bytes = aheads()
	}
	if n != 1 || bytes != float64(size) {
		t.Fatalf("after a view mounted onto cold caches: %v read-aheads of %v bytes, want 1 of %d", n, bytes, size)
	}
	run("warm")
	if n, _ := aheads(); n != 1 {
		t.Fatalf("a view mounted onto warm caches read ahead: %v read-aheads, want 1", n)
	}
	waitViewsReleased(t, s)
	s.RestartDaemonWith(t, "views.cold_read_ahead_mb = 0")
	dropCaches()
	run("cold-off")
	if n, _ := aheads(); n != 0 {
		t.Fatalf("views.cold_read_ahead_mb = 0: %v read-aheads", n)
	}
	waitViewsReleased(t, s)
	s.C.LeakCheck(t)
}

// TestKernelViewPreparedOnArrival: roots reach containers with their kernel view
// prepared. A container's commit (its fork's next root) and a root forked through
// tidepoold (as `tidepool fork` and `tidepool pull --fork` do), also right after a
// restart, have their images built in the background, for the workdir and owner of
// the views containers lately had; the containers that then run on them build
// nothing on their create path; so do roots `tidepool ingest` and `tidepool pull`
// put in the store (the CLI tells tidepoold), and a root ingested while tidepoold was
// stopped (the CLI records it; tidepoold prepares it when it starts). A restarted
// tidepoold decodes the trees of the roots it showed last, so a new image of one of
// them reads no tree object.
func TestKernelViewPreparedOnArrival(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, map[string]string{"src/main.go": "package main\n"}))
	agent := strings.TrimSpace(s.MustTidepool(t, "fork", root, "--label", "agent"))
	owner := binding.LabelOwner + "=1000:1000"
	images := func() float64 {
		return s.Metric(t, "tidepool_views_image_builds_total") + s.Metric(t, "tidepool_views_image_derived_total")
	}
	waitImages := func(want float64) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for images() < want && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if got := images(); got != want {
			t.Fatalf("%v images built, want %v", got, want)
		}
	}
	// run runs a container on fork that cats file and checks what it printed.
	run := func(id, fork, file, want string) {
		t.Helper()
		if out := runRm(t, s, id, forkLabels(fork, "/app", owner), imagebuild.BusyboxRef, "cat", file); out != want {
			t.Fatalf("%s read %q, want %q", id, out, want)
		}
	}
	runRm(t, s, "turn-1", forkLabels(agent, "/app", owner), imagebuild.BusyboxRef, "sh", "-c", "echo 1 > /app/turn")
	waitImages(2) // turn-1's view, then its commit's
	run("turn-2", agent, "/app/turn", "1\n")
	waitImages(2)

	// A root forked through tidepoold; the second time right after a restart (the
	// metrics start again at zero): the shapes of recent views outlive tidepoold.
	arrive := func(id, file, content string, built float64) {
		t.Helper()
		root := s.Ingest(t, writeTree(t, map[string]string{file: content}))
		forked := strings.TrimSpace(s.MustTidepool(t, "fork", root))
		waitImages(built)
		run(id, forked, "/app/"+file, content)
		waitImages(built)
	}
	arrive("forked", "lib/lib.go", "package lib\n", 3)
	waitViewsReleased(t, s)
	s.RestartDaemon(t)
	// The new tidepoold decodes the trees of the roots its images showed last, so the
	// image of agent's root at a workdir it never had reads no tree object.
	deadline := time.Now().Add(30 * time.Second)
	for s.Metric(t, "tidepool_views_trees_warmed_total") == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if s.Metric(t, "tidepool_views_trees_warmed_total") == 0 {
		t.Fatal("tidepoold decoded no trees of recent views when it started")
	}
	if out := runRm(t, s, "new-workdir", forkLabels(agent, "/elsewhere", owner), imagebuild.BusyboxRef, "cat", "/elsewhere/turn"); out != "1\n" {
		t.Fatalf("new-workdir read %q, want %q", out, "1\n")
	}
	waitImages(1)
	if r := s.Metric(t, "tidepool_views_image_trees_read_total"); r != 0 {
		t.Fatalf("the image of a root shown before the restart read %v tree objects, want 0", r)
	}
	arrive("after-restart", "cmd/main.go", "package main\n", 3) // for /elsewhere and /app
	// A root the CLI put in the store itself: tidepool ingest tells tidepoold.
	ingested := s.Ingest(t, writeTree(t, map[string]string{"pkg/p.go": "package p\n"}))
	waitImages(5) // for /app and /elsewhere
	run("ingested", ingested, "/app/pkg/p.go", "package p\n")
	waitImages(5)
	// A root another host pushed, pulled into the store: tidepool pull tells tidepoold.
	srv := s3test.Start(t)
	url := "s3://" + srv.Bucket + "/arrival"
	other := filepath.Join(t.TempDir(), "cas") // the other host's store: its ingest tells nobody here
	out := strings.Fields(s.MustTidepool(t, "--store", other, "ingest", writeTree(t, map[string]string{"web/w.go": "package web\n"})))
	pushed := out[len(out)-1]
	s.MustTidepool(t, "--store", other, "--remote", url, "push", pushed, "--ref", "web")
	waitImages(5)
	s.MustTidepool(t, "--remote", url, "pull", "web")
	waitImages(7) // for /app and /elsewhere
	run("pulled", pushed, "/app/web/w.go", "package web\n")
	waitImages(7)
	if n := s.Metric(t, "tidepool_snapshotter_roots_arrived_total", `via="api"`); n != 4 {
		t.Fatalf("%v roots told through the API since the restart, want 4 (an ingest and its fork, an ingest, a pull)", n)
	}

	// A root ingested while tidepoold is stopped: the CLI records it in the arrival
	// spool, and tidepoold prepares it when it starts. The record the other store's
	// ingest left is dropped unused.
	spool := filepath.Join(s.Root, "arrivals")
	if ents, _ := os.ReadDir(spool); len(ents) != 0 {
		t.Fatalf("arrival spool holds %d records, want none (every root was told)", len(ents))
	}
	s.MustTidepool(t, "--store", other, "ingest", writeTree(t, map[string]string{"doc/d.go": "package doc\n"}))
	if ents, _ := os.ReadDir(spool); len(ents) != 1 {
		t.Fatalf("arrival spool holds %d records, want 1 (the other store's)", len(ents))
	}
	waitViewsReleased(t, s)
	if err := s.Daemon.Stop(); err != nil {
		t.Fatal(err)
	}
	offline := s.Ingest(t, writeTree(t, map[string]string{"tool/t.go": "package tool\n"}))
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Fatalf("start tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
	waitImages(2) // for /app and /elsewhere
	if n := s.Metric(t, "tidepool_snapshotter_roots_arrived_total", `via="spool"`); n != 1 {
		t.Fatalf("%v roots taken from the arrival spool, want 1", n)
	}
	if ents, err := os.ReadDir(spool); err != nil || len(ents) != 0 {
		t.Fatalf("arrival spool after the start: %d records (%v), want none", len(ents), err)
	}
	hits := s.Metric(t, "tidepool_views_image_cache_hits_total")
	run("ingested-offline", offline, "/app/tool/t.go", "package tool\n")
	waitImages(2)
	if got := s.Metric(t, "tidepool_views_image_cache_hits_total"); got <= hits {
		t.Fatalf("the view of a root ingested while tidepoold was stopped was not found prepared (cache hits %v, then %v)", hits, got)
	}
	waitViewsReleased(t, s)
	s.C.LeakCheck(t)
}

// TestKernelViewCacheHitSeesRemovedObjects: a container on a cached image does not
// look its objects up again while the store's size index has forgotten nothing since
// they were all found in it, and does once an object leaves the store (fsck
// quarantines it, forgetting its size first): the tree then gets no kernel view (auto:
// a FUSE view, on which that file alone fails; kernel: the container is refused,
// naming the object), and once the object is back, a kernel view again.
func TestKernelViewCacheHitSeesRemovedObjects(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(t, writeTree(t, map[string]string{"a.txt": "alpha\n", "b.txt": "bravo\n"}))
	// Discarded, so that no commit builds the image of a next root (arrivals).
	labels := forkLabels(root, "/app", binding.LabelDiscard+"=true")
	script := "cat /app/a.txt; cat /app/b.txt 2>&1; true"
	const whole = "alpha\nbravo\n"
	run := func(id string) string {
		t.Helper()
		return runRm(t, s, id, labels, imagebuild.BusyboxRef, "sh", "-c", script)
	}
	checks := func() float64 { return s.Metric(t, "tidepool_views_image_object_checks_total") }
	hits := func() float64 { return s.Metric(t, "tidepool_views_image_cache_hits_total") }
	if out := run("build"); out != whole {
		t.Fatalf("first container printed %q, want %q", out, whole)
	}
	c0, h0 := checks(), hits()
	for i := range 2 {
		if out := run(fmt.Sprintf("hit-%d", i)); out != whole {
			t.Fatalf("container on the cached image printed %q, want %q", out, whole)
		}
	}
	if c, h := checks()-c0, hits()-h0; c != 0 || h < 2 {
		t.Fatalf("two containers on a cached image: %v cache hits, %v object lists checked; want 2 or more hits and no check", h, c)
	}

	store, err := casstore.Open(filepath.Join(s.Root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	b := casstore.Sum([]byte("bravo\n"))
	if err := os.WriteFile(store.Path(b), []byte("tampered\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, _ := s.Tidepool("fsck", "--quarantine"); !strings.Contains(out, "corrupt "+b.String()) {
		t.Fatalf("fsck --quarantine did not quarantine %s:\n%s", b, out)
	}
	if _, err := os.Stat(store.Path(b)); !os.IsNotExist(err) {
		t.Fatalf("quarantined object still in the store: %v", err)
	}
	c1 := checks()
	if os.Getenv("TIDEPOOL_VIEWS_MODE") == "kernel" {
		args := append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, labels...), imagebuild.BusyboxRef, "missing", "sh", "-c", script)
		if out, err := s.Ctr(args...); err == nil || !strings.Contains(err.Error(), b.String()) {
			t.Fatalf("views.mode kernel, an object missing: ctr run printed %q, error %v; want an error naming %s", out, err, b)
		}
	} else if out := run("missing"); !strings.HasPrefix(out, "alpha\n") || strings.Contains(out, "bravo") || !strings.Contains(out, "b.txt") {
		t.Fatalf("views.mode auto, an object missing: container printed %q, want a.txt's content and an error for b.txt alone", out)
	}
	if c := checks() - c1; c < 1 {
		t.Fatal("no object list checked after an object left the store")
	}

	if _, err := store.PutBytes([]byte("bravo\n")); err != nil {
		t.Fatal(err)
	}
	c2 := checks()
	if out := run("restored"); out != whole {
		t.Fatalf("object restored: container printed %q, want %q", out, whole)
	}
	if out := run("restored-hit"); out != whole {
		t.Fatalf("object restored, cached image: container printed %q, want %q", out, whole)
	}
	if c := checks() - c2; c != 1 {
		t.Fatalf("object restored: %v object lists checked by two containers, want 1 (the first)", c)
	}
	waitViewsReleased(t, s)
	s.C.LeakCheck(t)
}

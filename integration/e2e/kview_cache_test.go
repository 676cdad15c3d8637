package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
)

// TestKernelViewImageCacheDamaged: tidepoold writes its cached images without an
// fsync (kview's entry.go), so a host crash can leave one shorter than it was written.
// The tidepoold that starts after it builds that image again, says so in its log, and
// a container on the tree reads the whole tree. Before, the truncated image was
// mounted: the container's reads of the directories it lost failed with "structure
// needs cleaning", in every container on that tree until the image was collected.
// And an image cache removed under the running daemon is made again by the next build.
func TestKernelViewImageCacheDamaged(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	files := map[string]string{}
	for i := 0; i < 400; i++ { // an image of many blocks: a cut loses directories
		files[fmt.Sprintf("src/d%03d/f.go", i)] = fmt.Sprintf("package d%03d\n", i)
	}
	root := s.Ingest(t, writeTree(t, files))
	labels := forkLabels(root, "/app", binding.LabelOwner+"=1000:1000", binding.LabelDiscard+"=true")
	want := fmt.Sprintf("%d %s\n", len(files), catSum(files))
	run := func(id string) {
		t.Helper()
		script := "cd /app && n=$(find src -type f | wc -l) && sum=$(find src -type f | sort | xargs cat | md5sum | cut -d' ' -f1) && echo $n $sum"
		out, err := s.Ctr(append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, labels...),
			imagebuild.BusyboxRef, id, "sh", "-c", script)...)
		if err != nil || out != want {
			t.Fatalf("%s: printed %q, %v; want %q (files and md5 of the tree)", id, out, err, want)
		}
	}
	run("before-the-crash")
	waitViewsReleased(t, s)
	if err := s.Daemon.Kill(); err != nil {
		t.Fatal(err)
	}
	images, err := filepath.Glob(filepath.Join(s.Root, "kview", "images", "*.erofs"))
	if err != nil || len(images) != 1 {
		t.Fatalf("cached images %v, %v; want one", images, err)
	}
	info, err := os.Stat(images[0])
	if err != nil {
		t.Fatal(err)
	}
	// What is left of a file whose pages were written back in part: its first blocks.
	if err := os.Truncate(images[0], info.Size()/2&^4095); err != nil {
		t.Fatal(err)
	}
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Fatalf("start tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
	run("after-the-crash")
	if b := s.Metric(t, "tidepool_views_image_builds_total"); b != 1 {
		t.Errorf("%v images built by the restarted tidepoold, want 1", b)
	}
	log, err := os.ReadFile(s.Daemon.LogPath())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), "kernel view image cache entry is not whole") {
		t.Errorf("tidepoold's log does not say that it built the cut image again:\n%s", s.Daemon.LogTail(40))
	}
	// An operator clears the cache under the running daemon: the next container's
	// image is built into a cache directory made again (not served by FUSE for want
	// of one, as before).
	waitViewsReleased(t, s)
	if err := os.RemoveAll(filepath.Join(s.Root, "kview")); err != nil {
		t.Fatal(err)
	}
	run("after-the-cache-was-removed")
	if b := s.Metric(t, "tidepool_views_image_builds_total"); b != 2 {
		t.Errorf("%v images built by the restarted tidepoold, want 2", b)
	}
	waitViewsReleased(t, s)
	s.C.LeakCheck(t)
}

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// TestFleet: two hosts (two tidepoold with separate roots, two containerd) share one
// bucket. Host A ingests the Go source tree and pushes it as ref main; host B runs a
// container on the fork remote:main at /src, which reads and changes files through a
// lazily hydrated view; on removal B's commit is pushed and the ref advanced; A pulls
// it and `tidepool diff` shows exactly B's change.
func TestFleet(t *testing.T) {
	srv := s3test.Start(t) // sets AWS_* for the daemons and the CLI
	url := "s3://" + srv.Bucket + "/fleet"
	cfg := func(*stack.Stack) string {
		return fmt.Sprintf("[remote]\nurl = %q\nendpoint = %q\n", url, srv.Endpoint())
	}
	a := stack.Start(t, stack.Options{TidepooldConfig: cfg, Metrics: true})
	b := stack.Start(t, stack.Options{TidepooldConfig: cfg, Metrics: true})
	b.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")

	root := a.Ingest(t, filepath.Join(runtime.GOROOT(), "src"))
	a.MustTidepool(t, "--remote", url, "push", root, "--ref", "main")
	var refs []remote.Ref
	if err := json.Unmarshal([]byte(a.MustTidepool(t, "--remote", url, "refs", "--json")), &refs); err != nil {
		t.Fatal(err)
	}
	if len(refs) != 1 || refs[0].Name != "main" || refs[0].Root.String() != root {
		t.Fatalf("refs after A's push: %+v", refs)
	}

	script := strings.Join([]string{
		"head -1 /src/fmt/print.go",
		"echo '// changed on host B' >> /src/fmt/print.go",
		"echo hello > /src/fleet.txt",
		"rm /src/errors/errors_test.go",
	}, " && ")
	flags := []string{"--snapshotter", "tidepool",
		"--snapshotter-label", binding.LabelFork + "=" + binding.RemoteForkPrefix + "main",
		"--snapshotter-label", binding.LabelWorkdir + "=/src"}
	out := runRm(t, b, "fleet", flags, imagebuild.BusyboxRef, "sh", "-c", script)
	if !strings.HasPrefix(out, "// Copyright") {
		t.Fatalf("container read %q from fmt/print.go", out)
	}
	fetched := b.Metric(t, "tidepool_remote_objects_fetched_total")
	t.Logf("host B fetched %v objects to run the container", fetched)
	if fetched == 0 || fetched > 100 {
		t.Fatalf("host B fetched %v objects: want a lazy handful, not the tree", fetched)
	}

	r, err := remote.Open(remote.Config{URL: url, Endpoint: srv.Endpoint()})
	if err != nil {
		t.Fatal(err)
	}
	var newRoot string
	deadline := time.Now().Add(90 * time.Second)
	for {
		h, err := r.ResolveRef(context.Background(), "main")
		if err == nil && h.String() != root {
			newRoot = h.String()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ref main still at %s (%v) 90s after the container was removed\nhost B log:\n%s", root, err, b.Daemon.LogTail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}

	pulled := strings.TrimSpace(a.MustTidepool(t, "--remote", url, "pull", "main"))
	if pulled != newRoot {
		t.Fatalf("A pulled %s, want the ref's %s", pulled, newRoot)
	}
	diff := a.MustTidepool(t, "diff", root, newRoot)
	if want := "D errors/errors_test.go\nA fleet.txt\nM fmt/print.go\n"; diff != want {
		t.Fatalf("A sees B's change as:\n%s\nwant:\n%s", diff, want)
	}
	if got := a.MustTidepool(t, "cat", newRoot, "fleet.txt"); got != "hello\n" {
		t.Fatalf("fleet.txt: %q", got)
	}
	a.MustTidepool(t, "fsck")

	// Concurrent commits from both hosts to main: one advances it, the other becomes
	// a conflict ref, and both roots are complete in the bucket.
	a.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	hosts := map[string]*stack.Stack{"race-a": a, "race-b": b}
	var wg sync.WaitGroup
	for id, s := range hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runRm(t, s, id, flags, imagebuild.BusyboxRef, "sh", "-c", "echo "+id+" > /src/fleet.txt")
		}()
	}
	wg.Wait()
	roots := map[string]string{}
	for id, s := range hosts {
		roots[forkOfContainer(t, s, id, newRoot).Root.String()] = id
	}
	var refs2 []remote.Ref
	deadline = time.Now().Add(90 * time.Second)
	for {
		if err := json.Unmarshal([]byte(a.MustTidepool(t, "--remote", url, "refs", "--json")), &refs2); err != nil {
			t.Fatal(err)
		}
		if len(refs2) == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(refs2) != 2 || refs2[0].Name != "main" || refs2[1].Conflict != "main" ||
		roots[refs2[0].Root.String()] == "" || roots[refs2[1].Root.String()] == "" || refs2[0].Root == refs2[1].Root {
		t.Fatalf("after concurrent commits of %v: refs %+v", roots, refs2)
	}
	if want := remote.ConflictName("main", refs2[1].Root); refs2[1].Name != want {
		t.Fatalf("conflict ref %s, want %s", refs2[1].Name, want)
	}
	t.Logf("%s won, %s became %s", roots[refs2[0].Root.String()], roots[refs2[1].Root.String()], refs2[1].Name)
	c := stack.Start(t, stack.Options{}) // a third, empty host checks both roots
	c.MustTidepool(t, "--remote", url, "pull", newRoot)
	for _, ref := range refs2 {
		got := strings.TrimSpace(c.MustTidepool(t, "--remote", url, "pull", ref.Name, "--fork"))
		if diff := c.MustTidepool(t, "diff", newRoot, got); diff != "M fleet.txt\n" {
			t.Fatalf("%s: diff from B's commit:\n%s", ref.Name, diff)
		}
	}
	c.MustTidepool(t, "fsck")
	if n := a.Metric(t, "tidepool_remote_cas_conflicts_total") + b.Metric(t, "tidepool_remote_cas_conflicts_total"); n != 1 {
		t.Fatalf("CAS conflicts counted: %v, want 1", n)
	}

	// The bucket unreachable: the create fails with an error naming the remote, and
	// leaves nothing behind; once it is back, the same run works.
	srv.Kill()
	args := append(append([]string{"run", "--rm", "--fifo-dir", b.C.FIFODir}, flags...), imagebuild.BusyboxRef, "down", "true")
	if out, err := b.Ctr(args...); err == nil || !strings.Contains(err.Error()+out, url) {
		t.Fatalf("run with the bucket down: %v\n%s", err, out)
	} else {
		t.Logf("bucket down: %v", err)
	}
	srv.Restart(t)
	runRm(t, b, "up", flags, imagebuild.BusyboxRef, "true")
	a.C.LeakCheck(t)
	b.C.LeakCheck(t)
}

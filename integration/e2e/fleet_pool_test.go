package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/fsck"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// TestPoolRunRemoteFork: `tidepool run --pool P --fork remote:NAME` on a warm pool
// member. The ref was pushed by another host (a store this host's tidepoold has never
// seen), so the claim hydrates the fork from the bucket; the command's change is
// committed and pushed back, and the ref advanced by compare-and-swap. A second run
// whose ref moves while it runs loses the race: its commit becomes the conflict ref,
// the ref keeps the other writer's root, and the conflict is counted.
func TestPoolRunRemoteFork(t *testing.T) {
	srv := s3test.Start(t) // sets AWS_* for the daemon and the CLI
	url := "s3://" + srv.Bucket + "/pool"
	s := stack.Start(t, stack.Options{Metrics: true, TidepooldConfig: func(s *stack.Stack) string {
		return fmt.Sprintf("[remote]\nurl = %q\nendpoint = %q\n", url, srv.Endpoint()) +
			s.PoolConfig(stack.Pool{Name: "box", Image: imagebuild.BusyboxRef, Target: 1})
	}})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")

	// "Host A": a store of its own pushes ref main.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	other, err := casstore.Open(filepath.Join(t.TempDir(), "cas"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Settle) // a pull's objects reach their names in the background
	r, err := remote.Open(remote.Config{URL: url, Endpoint: srv.Endpoint()})
	if err != nil {
		t.Fatal(err)
	}
	root0, _, err := ingest.Dir(ctx, other, writeTree(t, map[string]string{
		"README.md": "# pooled\n", "src/a.txt": "alpha\n", "src/b.txt": "beta\n",
	}), ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Push(ctx, other, root0, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := s.Tidepool("cat", root0.String(), "README.md"); ok != "" {
		t.Fatal("the host already has the ref's root: nothing would be hydrated")
	}
	waitPool(t, s, "box", 1)

	out, errOut, code := tidepoolRun(t, s, "", "--pool", "box", "--fork", "remote:main", "--",
		"sh", "-c", "cat /app/src/a.txt && echo gamma > /app/src/c.txt && rm /app/src/b.txt")
	if code != 0 || out != "alpha\n" {
		t.Fatalf("run on remote:main: exit %d, stdout %q, stderr %q\n%s", code, out, errOut, s.Daemon.LogTail(30))
	}
	if n := s.Metric(t, "tidepool_remote_objects_fetched_total"); n == 0 {
		t.Fatal("the claim fetched nothing from the bucket")
	}
	// The run answers after its commit, and the commit is pushed before it answers.
	root1, err := r.ResolveRef(ctx, "main")
	if err != nil || root1 == root0 {
		t.Fatalf("ref main = %s, %v after the run; want a new root\n%s", root1, err, s.Daemon.LogTail(30))
	}
	if d := s.MustTidepool(t, "diff", root0.String(), root1.String()); d != "D src/b.txt\nA src/c.txt\n" {
		t.Fatalf("the pushed commit changes:\n%s", d)
	}
	// The bucket holds the commit completely: host A pulls it into its own store.
	if _, err := r.Pull(ctx, other, root1); err != nil {
		t.Fatal(err)
	}
	if b, err := other.ReadAll(lookup(t, other, root1, "src", "c.txt"), 1<<20); err != nil || string(b) != "gamma\n" {
		t.Fatalf("src/c.txt on host A: %q, %v", b, err)
	}
	waitPool(t, s, "box", 1)

	// A lost race: the ref moves while the command runs.
	cmd := exec.Command(filepath.Join(s.Bin, "tidepool"), "--root", s.Root, "run", "--pool", "box", "--fork", "remote:main", "--",
		"sh", "-c", "echo ready && read line && echo $line > /app/src/a.txt")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var runErr bytes.Buffer
	cmd.Stderr = &runErr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	lines := bufio.NewReader(stdout)
	if l, err := lines.ReadString('\n'); err != nil || l != "ready\n" {
		t.Fatalf("second run said %q, %v; stderr %q", l, err, runErr.String())
	}
	// Host A advances main meanwhile.
	root2, _, err := ingest.Dir(ctx, other, writeTree(t, map[string]string{
		"README.md": "# pooled\n", "src/a.txt": "from host A\n", "src/c.txt": "gamma\n",
	}), ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Push(ctx, other, root2, remote.PushOptions{Ref: "main", Expect: &root1}); err != nil {
		t.Fatal(err)
	}
	io.WriteString(stdin, "from the pool\n")
	stdin.Close()
	rest, _ := io.ReadAll(lines)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("second run: %v, stdout %q, stderr %q", err, rest, runErr.String())
	}
	if got, err := r.ResolveRef(ctx, "main"); err != nil || got != root2 {
		t.Fatalf("ref main = %s, %v; want host A's %s (the pool's commit lost the race)", got, err, root2)
	}
	refs, err := r.ListRefs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var conflict *remote.Ref
	for i := range refs {
		if refs[i].Conflict == "main" {
			conflict = &refs[i]
		}
	}
	if conflict == nil || len(refs) != 2 {
		t.Fatalf("refs after the lost race: %+v; want main and one conflict ref", refs)
	}
	if d := s.MustTidepool(t, "diff", root1.String(), conflict.Root.String()); d != "M src/a.txt\n" {
		t.Fatalf("the conflict ref's root changes:\n%s", d)
	}
	if got := s.MustTidepool(t, "cat", conflict.Root.String(), "src/a.txt"); got != "from the pool\n" {
		t.Fatalf("conflict root's src/a.txt = %q", got)
	}
	if n := s.Metric(t, "tidepool_remote_cas_conflicts_total"); n != 1 {
		t.Fatalf("CAS conflicts counted: %v, want 1", n)
	}
	if !strings.Contains(s.Daemon.LogTail(200), "conflict ref") {
		t.Fatalf("no log line for the lost race:\n%s", s.Daemon.LogTail(40))
	}
	// Both roots are complete in the bucket: each pulls into an empty store that
	// fsck then finds healthy. (Not this host's store: its FUSE views fetched only
	// the files the commands read, so objects never read are missing there by design.)
	for _, h := range []casstore.Hash{root2, conflict.Root} {
		fresh, err := casstore.Open(filepath.Join(t.TempDir(), "cas"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Pull(ctx, fresh, h); err != nil {
			t.Fatalf("pull %s into an empty store: %v", h, err)
		}
		rep, err := fsck.Check(ctx, fresh, nil, fsck.Options{Roots: []casstore.Hash{h}})
		if err != nil {
			t.Fatal(err)
		}
		if !rep.Healthy() {
			t.Fatalf("fsck of %s pulled into an empty store: missing %v, bad %v", h, rep.Missing, rep.Bad)
		}
		fresh.Settle()
		os.RemoveAll(fresh.Root())
	}
	waitPool(t, s, "box", 1) // the pool refilled; the stack's cleanup drains it
}

// lookup finds the object at path under root in s.
func lookup(t *testing.T, s *casstore.Store, root casstore.Hash, path ...string) casstore.Hash {
	t.Helper()
	h := root
	for _, name := range path {
		tr, err := s.ReadTree(h)
		if err != nil {
			t.Fatal(err)
		}
		e, ok := tr.Lookup(name)
		if !ok {
			t.Fatalf("%s not found", strings.Join(path, "/"))
		}
		h = e.Hash
	}
	return h
}

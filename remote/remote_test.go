package remote_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/minio/minio-go/v7"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/fsck"
	"github.com/tidepool-dev/tidepool/casstore/gc"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/kview"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

const prefix = "fleet/one"

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func openRemote(t *testing.T, srv *s3test.Server, conc int) *remote.Remote {
	t.Helper()
	r, err := remote.Open(remote.Config{URL: "s3://" + srv.Bucket + "/" + prefix, Endpoint: srv.Endpoint(), Concurrency: conc})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// openRemoteNoPacks opens the remote in LunarFS's layout alone: no packs written or
// read, every object its own request.
func openRemoteNoPacks(t *testing.T, srv *s3test.Server, conc int) *remote.Remote {
	t.Helper()
	r, err := remote.Open(remote.Config{URL: "s3://" + srv.Bucket + "/" + prefix, Endpoint: srv.Endpoint(), Concurrency: conc, NoPacks: true})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// pullKilledMidway pulls root into b and kills the server once after objects are
// fetched: the pull must fail with one line naming the remote, leaving only whole
// objects and no temp files.
func pullKilledMidway(ctx context.Context, t *testing.T, srv *s3test.Server, r *remote.Remote, b *casstore.Store, root casstore.Hash, after int64) {
	t.Helper()
	done := make(chan error, 1)
	go func() { _, err := r.Pull(ctx, b, root); done <- err }()
	for r.Metrics().Snapshot().ObjectsFetched < after {
		select {
		case err := <-done:
			t.Fatalf("pull finished before the server could be killed: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
	srv.Kill()
	err := <-done
	if err == nil {
		t.Fatal("pull succeeded with the server killed midway")
	}
	if !strings.Contains(err.Error(), "s3://"+srv.Bucket+"/"+prefix) || strings.Contains(err.Error(), "\n") {
		t.Fatalf("error does not name the remote on one line: %v", err)
	}
	t.Logf("interrupted pull: %v (metrics %+v)", err, r.Metrics().Snapshot())
	checkComplete(t, b) // every object present is whole
	b.Settle()          // what the pull committed is under its names, its journal gone
	noLeftovers(t, b)
}

// noLeftovers fails if s holds temp files or journals.
func noLeftovers(t *testing.T, s *casstore.Store) {
	t.Helper()
	tmp, err := s.TempFiles()
	if err != nil {
		t.Fatal(err)
	}
	js, err := s.Journals()
	if err != nil {
		t.Fatal(err)
	}
	if len(tmp) != 0 || len(js) != 0 {
		t.Fatalf("left behind: temp files %v, journals %v", tmp, js)
	}
}

func newStore(t *testing.T) *casstore.Store {
	t.Helper()
	s, err := casstore.Open(filepath.Join(t.TempDir(), "cas"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Settle) // before the directory goes: pulls settle in the background
	return s
}

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for p, c := range files {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		mode := os.FileMode(0o644)
		if strings.HasSuffix(p, ".sh") {
			mode = 0o755
		}
		if err := os.WriteFile(full, []byte(c), mode); err != nil {
			t.Fatal(err)
		}
	}
}

func ingestDir(t *testing.T, s *casstore.Store, dir string) casstore.Hash {
	t.Helper()
	root, _, err := ingest.Dir(context.Background(), s, dir, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// sample is a small tree with nesting, an empty file, an empty directory, an
// executable, a symlink and a shared blob.
func sample(t *testing.T, s *casstore.Store) (string, casstore.Hash) {
	dir := t.TempDir()
	writeFiles(t, dir, map[string]string{
		"README.md": "# sample\n", "a/b/c.txt": "deep\n", "a/b/same.txt": "shared\n", "x/same.txt": "shared\n",
		"run.sh": "#!/bin/sh\necho hi\n", "empty": "",
	})
	if err := os.Mkdir(filepath.Join(dir, "emptydir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("a/b/c.txt", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	return dir, ingestDir(t, s, dir)
}

// reachable lists every object reachable from root in s (trees and blobs).
func reachable(t *testing.T, s *casstore.Store, root casstore.Hash) map[casstore.Hash]bool {
	t.Helper()
	seen := map[casstore.Hash]bool{root: true}
	var walk func(h casstore.Hash)
	walk = func(h casstore.Hash) {
		tr, err := s.ReadTree(h)
		if err != nil {
			t.Fatalf("read tree %s: %v", h, err)
		}
		for _, e := range tr {
			if seen[e.Hash] && !e.Mode.IsDir() {
				continue
			}
			seen[e.Hash] = true
			if e.Mode.IsDir() {
				walk(e.Hash)
			}
		}
	}
	walk(root)
	return seen
}

// objectBytes reads object h of s through the store, as every reader does: a pull
// returns once its journal is durable and its objects reach their names in the
// background (casstore's late.go), so a file read by path right after it may not be
// there yet.
func objectBytes(t *testing.T, s *casstore.Store, h casstore.Hash) []byte {
	t.Helper()
	b, err := s.ReadAll(h, 1<<30)
	if err != nil {
		t.Fatalf("read object %s: %v", h, err)
	}
	return b
}

// checkComplete fscks s with root as a live root: every object re-hashed, every
// reachable object present.
func checkComplete(t *testing.T, s *casstore.Store, roots ...casstore.Hash) {
	t.Helper()
	rep, err := fsck.Check(context.Background(), s, nil, fsck.Options{Roots: roots})
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Healthy() {
		t.Fatalf("store %s not healthy: bad %v missing %v undecodable %v unreadable %v", s.Root(), rep.Bad, rep.Missing, rep.Undecodable, rep.Unreadable)
	}
}

// checkBucketComplete pulls root into an empty store and fscks it.
func checkBucketComplete(t *testing.T, srv *s3test.Server, root casstore.Hash) {
	t.Helper()
	s := newStore(t)
	if _, err := openRemote(t, srv, 8).Pull(ctxT(t), s, root); err != nil {
		t.Fatalf("pull %s into a fresh store: %v", root, err)
	}
	checkComplete(t, s, root)
}

func TestPushPullRoundTrip(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a, b := newStore(t), newStore(t)
	_, root := sample(t, a)
	r := openRemote(t, srv, 8)

	res, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"})
	if err != nil {
		t.Fatal(err)
	}
	want := reachable(t, a, root)
	if res.Objects != int64(len(want)) {
		t.Fatalf("first push uploaded %d objects, want %d", res.Objects, len(want))
	}
	if !res.Previous.IsZero() {
		t.Fatalf("created ref reports previous root %s", res.Previous)
	}
	again, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"})
	if err != nil || again.Objects != 0 {
		t.Fatalf("second push: %+v, %v; want nothing uploaded", again, err)
	}
	// The ref already names the root: one GET of the ref, nothing else.
	if again.Requests != 1 {
		t.Fatalf("second push made %d requests, want 1", again.Requests)
	}
	// Without a ref, one HEAD of the root tells that the whole tree is there.
	if res, err := r.Push(ctx, a, root, remote.PushOptions{}); err != nil || res.Requests != 1 || res.Objects != 0 {
		t.Fatalf("push without a ref: %+v, %v; want 1 request", res, err)
	}

	got, err := r.ResolveRef(ctx, "main")
	if err != nil || got != root {
		t.Fatalf("ref main = %s, %v; want %s", got, err, root)
	}
	pr, err := r.Pull(ctx, b, got)
	if err != nil {
		t.Fatal(err)
	}
	// H("") is made locally, never fetched.
	if fetched := int64(len(want)) - 1; pr.Objects != fetched {
		t.Fatalf("pull fetched %d objects, want %d", pr.Objects, fetched)
	}
	checkComplete(t, b, root)
	for h := range want {
		if x, y := objectBytes(t, a, h), objectBytes(t, b, h); !bytes.Equal(x, y) {
			t.Fatalf("object %s differs after the round trip", h)
		}
	}
	pr, err = r.Pull(ctx, b, root)
	if err != nil || pr.Objects != 0 {
		t.Fatalf("second pull: %+v, %v; want nothing fetched", pr, err)
	}
	if st := r.Metrics().Snapshot(); st.VerifyFailures != 0 || st.ObjectsFetched != int64(len(want))-1 {
		t.Fatalf("metrics %+v", st)
	}

	refs, err := r.ListRefs(ctx)
	if err != nil || len(refs) != 1 || refs[0].Name != "main" || refs[0].Root != root {
		t.Fatalf("ListRefs = %+v, %v", refs, err)
	}
	if err := r.DeleteRef(ctx, "main"); err != nil {
		t.Fatal(err)
	}
	if err := r.DeleteRef(ctx, "main"); !errdefs.IsNotFound(err) {
		t.Fatalf("second DeleteRef: %v, want not found", err)
	}
	if _, err := r.ResolveRef(ctx, "main"); !errdefs.IsNotFound(err) {
		t.Fatalf("ResolveRef after rm: %v", err)
	}
}

// TestBucketLayout reads the bucket with plain S3 calls and checks it against
// LunarFS's server layout, with the G8 fixture (5 objects, then 0 on a re-push).
func TestBucketLayout(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	s := newStore(t)
	dir := t.TempDir()
	writeFiles(t, dir, map[string]string{
		"README.md": "# Dev Dropbox\n", "src/main.rs": "fn main() { println!(\"hello\"); }\n",
		"src/lib.rs": "pub fn greet() -> &'static str { \"hello\" }\n",
	})
	root := ingestDir(t, s, dir)
	r := openRemote(t, srv, 4)
	res, err := r.Push(ctx, s, root, remote.PushOptions{Ref: "dev"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Objects != 5 {
		t.Fatalf("push uploaded %d objects, want 5 (G8)", res.Objects)
	}

	c := srv.Client(t)
	var keys []string
	for o := range c.ListObjects(ctx, srv.Bucket, minio.ListObjectsOptions{Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		keys = append(keys, o.Key)
	}
	blobs := 0
	for _, k := range keys {
		obj, err := c.GetObject(ctx, srv.Bucket, k, minio.GetObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(obj)
		obj.Close()
		if err != nil {
			t.Fatal(err)
		}
		rest, ok := strings.CutPrefix(k, prefix+"/")
		if !ok {
			t.Fatalf("key %q outside the prefix %q", k, prefix)
		}
		switch {
		case strings.HasPrefix(rest, "blobs/"):
			parts := strings.Split(rest, "/")
			if len(parts) != 3 || len(parts[1]) != 2 || len(parts[2]) != 62 {
				t.Fatalf("blob key %q is not blobs/<hh>/<62 hex>", k)
			}
			if got := casstore.Sum(body).String(); got != parts[1]+parts[2] {
				t.Fatalf("blob %q holds bytes hashing to %s", k, got)
			}
			if local := objectBytes(t, s, casstore.Sum(body)); !bytes.Equal(local, body) {
				t.Fatalf("blob %q differs from the local object", k)
			}
			blobs++
		case rest == "packs/"+root.String():
			// Beside the layout: the push's pack (pack.go), holding the same 5 objects.
			head, ents := parsePack(t, body)
			if head.root != root || !head.base.IsZero() || len(ents) != 5 {
				t.Fatalf("pack %q: root %s base %s, %d entries; want root, no base, 5", k, head.root, head.base, len(ents))
			}
			for h, b := range ents {
				if local := objectBytes(t, s, h); !bytes.Equal(local, b) {
					t.Fatalf("pack entry %s differs from the local object", h)
				}
			}
		case rest == "ref/dev":
			if want := `{"root":"` + root.String() + `"}`; string(body) != want {
				t.Fatalf("ref body %q, want exactly %q", body, want)
			}
		default:
			t.Fatalf("unexpected key %q", k)
		}
	}
	if blobs != 5 || len(keys) != 7 {
		t.Fatalf("bucket holds %v; want 5 blobs, ref/dev and the pack", keys)
	}
	res, err = r.Push(ctx, s, root, remote.PushOptions{})
	if err != nil || res.Objects != 0 {
		t.Fatalf("re-push: %+v, %v; want 0 objects (G8)", res, err)
	}
}

// TestConcurrentCAS pushes two different commits of one ref from two stores at the
// same time, both expecting the same starting root: one advances the ref, the other
// becomes a conflict ref, and both roots are complete in the bucket.
func TestConcurrentCAS(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	base := newStore(t)
	dir, r0 := sample(t, base)
	if _, err := openRemote(t, srv, 8).Push(ctx, base, r0, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	stores := [2]*casstore.Store{newStore(t), newStore(t)}
	var roots [2]casstore.Hash
	for i, s := range stores {
		if _, err := openRemote(t, srv, 8).Pull(ctx, s, r0); err != nil {
			t.Fatal(err)
		}
		writeFiles(t, dir, map[string]string{"a/b/c.txt": fmt.Sprintf("host %d\n", i), fmt.Sprintf("new-%d/f", i): "x"})
		roots[i] = ingestDir(t, s, dir)
		os.RemoveAll(filepath.Join(dir, fmt.Sprintf("new-%d", i)))
	}
	for round := 0; round < 3; round++ {
		ref := fmt.Sprintf("race-%d", round)
		if _, err := openRemote(t, srv, 8).Push(ctx, base, r0, remote.PushOptions{Ref: ref}); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var errs [2]error
		remotes := [2]*remote.Remote{openRemote(t, srv, 8), openRemote(t, srv, 8)}
		start := make(chan struct{})
		for i := range stores {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				_, errs[i] = remotes[i].Push(ctx, stores[i], roots[i], remote.PushOptions{Ref: ref, Expect: &r0})
			}()
		}
		close(start)
		wg.Wait()
		winner, loser := 0, 1
		if errs[0] != nil {
			winner, loser = 1, 0
		}
		if errs[winner] != nil {
			t.Fatalf("round %d: both pushes failed: %v / %v", round, errs[0], errs[1])
		}
		var ce *remote.ConflictError
		if !errors.As(errs[loser], &ce) || !errdefs.IsConflict(errs[loser]) {
			t.Fatalf("round %d: loser got %v, want a conflict", round, errs[loser])
		}
		if ce.ConflictRef != remote.ConflictName(ref, roots[loser]) || ce.Current != roots[winner] {
			t.Fatalf("round %d: conflict %+v", round, ce)
		}
		if got := remotes[loser].Metrics().Snapshot().CASConflicts; got != 1 {
			t.Fatalf("round %d: loser counted %d CAS conflicts", round, got)
		}
		r := openRemote(t, srv, 8)
		if got, err := r.ResolveRef(ctx, ref); err != nil || got != roots[winner] {
			t.Fatalf("round %d: ref = %s, %v; want the winner %s", round, got, err, roots[winner])
		}
		if got, err := r.ResolveRef(ctx, ce.ConflictRef); err != nil || got != roots[loser] {
			t.Fatalf("round %d: conflict ref = %s, %v; want the loser %s", round, got, err, roots[loser])
		}
	}
	checkBucketComplete(t, srv, roots[0])
	checkBucketComplete(t, srv, roots[1])

	// A stale ETag loses deterministically too.
	r := openRemote(t, srv, 8)
	stale, err := r.GetRef(ctx, "race-0")
	if err != nil {
		t.Fatal(err)
	}
	if err := r.CASRef(ctx, "race-0", r0, stale); err != nil {
		t.Fatal(err)
	}
	if err := r.CASRef(ctx, "race-0", roots[0], stale); !errdefs.IsConflict(err) {
		t.Fatalf("CAS with a stale ETag: %v, want a conflict", err)
	}
	// A retried push of the root the ref already has succeeds whatever it expected.
	if _, err := r.Push(ctx, stores[0], r0, remote.PushOptions{Ref: "race-0", Expect: &roots[1]}); err != nil {
		t.Fatalf("re-push of the ref's own root: %v", err)
	}
	// Creating a ref that exists is a conflict as well.
	if err := r.CASRef(ctx, "race-0", roots[1], remote.Ref{}); !errdefs.IsConflict(err) {
		t.Fatalf("create over an existing ref: %v, want a conflict", err)
	}
}

// bigTree writes n files of size bytes spread over directories and ingests them.
func bigTree(t *testing.T, s *casstore.Store, n, size int) (string, casstore.Hash) {
	dir := t.TempDir()
	files := map[string]string{}
	for i := 0; i < n; i++ {
		files[fmt.Sprintf("d%02d/e%02d/f%04d", i%20, i%7, i)] = fmt.Sprintf("%d", i) + strings.Repeat("x", size)
	}
	writeFiles(t, dir, files)
	return dir, ingestDir(t, s, dir)
}

// pushedTree starts a server and pushes a bigTree of n files to it from a store a.
func pushedTree(t *testing.T, n, size int) (srv *s3test.Server, ctx context.Context, a *casstore.Store, root casstore.Hash) {
	t.Helper()
	srv = s3test.Start(t)
	ctx = ctxT(t)
	a = newStore(t)
	_, root = bigTree(t, a, n, size)
	if _, err := openRemote(t, srv, 16).Push(ctx, a, root, remote.PushOptions{}); err != nil {
		t.Fatal(err)
	}
	return srv, ctx, a, root
}

func TestPullInterrupted(t *testing.T) {
	srv, ctx, _, root := pushedTree(t, 1500, 2000)
	b := newStore(t)
	// The per-object path; pack_test.go interrupts a pack.
	pullKilledMidway(ctx, t, srv, openRemoteNoPacks(t, srv, 2), b, root, 200)
	srv.Restart(t)
	pr, err := openRemote(t, srv, 8).Pull(ctx, b, root)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Present == 0 {
		t.Fatal("the re-run fetched everything again: nothing of the interrupted pull was kept")
	}
	t.Logf("re-run fetched %d objects, %d were already present", pr.Objects, pr.Present)
	checkComplete(t, b, root)
}

func TestCorruptObjectRefused(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	_, root := sample(t, a)
	r := openRemote(t, srv, 4)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{}); err != nil {
		t.Fatal(err)
	}
	victim := casstore.Sum([]byte("deep\n"))
	evil := []byte("evil\n")
	putRaw(t, srv, r.BlobKey(victim), evil)
	// Object by object (a pack holds the right bytes; pack_test.go corrupts one).
	r = openRemoteNoPacks(t, srv, 4)
	b := newStore(t)
	_, err := r.Pull(ctx, b, root)
	if !errdefs.IsDataLoss(err) {
		t.Fatalf("pull of a corrupted bucket: %v, want a data-loss error", err)
	}
	var ce *casstore.CorruptError
	if !errors.As(err, &ce) || ce.Hash != victim || ce.Got != casstore.Sum(evil) {
		t.Fatalf("error %v does not name the object", err)
	}
	if got := r.Metrics().Snapshot().VerifyFailures; got != 1 {
		t.Fatalf("verify failures = %d, want 1", got)
	}
	for _, h := range []casstore.Hash{victim, casstore.Sum(evil)} {
		if ok, _ := b.Has(h); ok {
			t.Fatalf("object %s was stored", h)
		}
	}
	checkComplete(t, b)

	// The lazy path (a FUSE view's BlobSource) refuses it as well.
	rc, err := r.Fetch(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	_, err = io.ReadAll(rc)
	rc.Close()
	if !errdefs.IsDataLoss(err) {
		t.Fatalf("Fetch of a corrupted object read to the end with %v", err)
	}
	if got := r.Metrics().Snapshot().VerifyFailures; got != 2 {
		t.Fatalf("verify failures = %d, want 2", got)
	}
}

func TestWrongCredentials(t *testing.T) {
	srv := s3test.Start(t)
	t.Setenv("AWS_SECRET_ACCESS_KEY", "not-the-password")
	r := openRemote(t, srv, 4)
	_, err := r.ListRefs(ctxT(t))
	if !errdefs.IsPermissionDenied(err) {
		t.Fatalf("ListRefs with a wrong secret: %v, want permission denied", err)
	}
	msg := err.Error()
	if strings.Contains(msg, "\n") || !strings.Contains(msg, "AWS_SECRET_ACCESS_KEY") || !strings.Contains(msg, "s3://") {
		t.Fatalf("not one clear line: %q", msg)
	}
	s := newStore(t)
	_, root := sample(t, s)
	if _, err := r.Push(ctxT(t), s, root, remote.PushOptions{Ref: "main"}); !errdefs.IsPermissionDenied(err) {
		t.Fatalf("push with a wrong secret: %v", err)
	}
	t.Logf("%v", err)
}

func TestUnreachable(t *testing.T) {
	srv := s3test.Start(t)
	srv.Kill()
	r := openRemote(t, srv, 4)
	_, err := r.ResolveRef(ctxT(t), "main")
	if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), srv.Addr) {
		t.Fatalf("unreachable remote: %v", err)
	}
}

// TestPushAfterSmallCommit counts the requests a push makes after ten files
// changed: at most three per changed path component (changed file or tree).
func TestPushAfterSmallCommit(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	s := newStore(t)
	dir, r0 := bigTree(t, s, 2000, 100)
	r := openRemote(t, srv, 16)
	full, err := r.Push(ctx, s, r0, remote.PushOptions{Ref: "main"})
	if err != nil {
		t.Fatal(err)
	}
	changed := map[string]string{}
	for i := 0; i < 10; i++ {
		n := i * 137
		changed[fmt.Sprintf("d%02d/e%02d/f%04d", n%20, n%7, n)] = fmt.Sprintf("changed %d", i)
	}
	writeFiles(t, dir, changed)
	r1 := ingestDir(t, s, dir)
	old := reachable(t, s, r0)
	components := 0
	for h := range reachable(t, s, r1) {
		if !old[h] {
			components++
		}
	}
	res, err := r.Push(ctx, s, r1, remote.PushOptions{Ref: "main", Expect: &r0})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("full push: %d objects, %d requests; after a 10-file commit: %d objects, %d requests for %d changed path components",
		full.Objects, full.Requests, res.Objects, res.Requests, components)
	if res.Objects != int64(components) {
		t.Fatalf("uploaded %d objects, want the %d changed ones", res.Objects, components)
	}
	if res.Requests > int64(3*components) {
		t.Fatalf("%d requests for %d changed path components: more than 3 each", res.Requests, components)
	}
	checkBucketComplete(t, srv, r1)
}

// putRaw writes an object into the bucket behind Tidepool's back.
func putRaw(t *testing.T, srv *s3test.Server, key string, data []byte) {
	t.Helper()
	if _, err := srv.Client(t).PutObject(context.Background(), srv.Bucket, key, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestPullReadableAtOnce: when Pull returns, every object of the root is durable (in
// the pull's journal) and readable through the store API, objects not under their
// names yet included; a kernel view's scan right after finds every object as a file
// under its name (what the view's image reads); after settling, the journal is gone
// and the store is LunarFS's layout alone. Both the pack and the per-object path.
func TestPullReadableAtOnce(t *testing.T) {
	srv, ctx, a, root := pushedTree(t, 1500, 3000)
	want := reachable(t, a, root)
	for _, packs := range []bool{true, false} {
		t.Run(fmt.Sprintf("packs=%v", packs), func(t *testing.T) {
			r := openRemote(t, srv, 8)
			if !packs {
				r = openRemoteNoPacks(t, srv, 8)
			}
			b := newStore(t)
			if _, err := r.Pull(ctx, b, root); err != nil {
				t.Fatal(err)
			}
			js, err := b.Journals()
			if err != nil || len(js) != 1 {
				t.Fatalf("journals right after the pull: %v, %v; want the pull's", js, err)
			}
			notPlaced := 0
			for h := range want {
				if _, err := os.Lstat(b.Path(h)); err != nil {
					notPlaced++
				}
			}
			t.Logf("%d of %d objects not under their names yet when Pull returned", notPlaced, len(want))
			for h := range want {
				f, err := b.Open(h) // verified against its name
				if err != nil {
					t.Fatal(err)
				}
				f.Close()
			}
			if _, err := kview.Scan(ctx, b, kview.Spec{Root: root}); err != nil {
				t.Fatalf("kernel view scan right after the pull: %v", err)
			}
			for h := range want {
				if _, err := os.Lstat(b.Path(h)); err != nil {
					t.Fatalf("after the view's scan, object %s is not under its name: %v", h, err)
				}
			}
			b.Settle()
			noLeftovers(t, b)
			checkComplete(t, b, root)
		})
	}
}

// TestPullGCWhileSettling: collections with no grace period, run while a pull's
// objects are being written under their names and settled, lose none of them.
func TestPullGCWhileSettling(t *testing.T) {
	srv, ctx, _, root := pushedTree(t, 1500, 3000)
	b := newStore(t)
	if _, err := openRemote(t, srv, 8).Pull(ctx, b, root); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var swept int
	go func() {
		defer close(done)
		for i := 0; i < 5; i++ {
			res, err := gc.Collect(ctx, b, nil, gc.Options{Grace: -1, Roots: []casstore.Hash{root}})
			if err != nil {
				t.Errorf("gc: %v", err)
				return
			}
			swept += res.Swept + len(res.Missing)
		}
	}()
	b.Settle()
	<-done
	if swept != 0 {
		t.Fatalf("collections swept or missed %d objects of a live root", swept)
	}
	checkComplete(t, b, root)
	noLeftovers(t, b)
}

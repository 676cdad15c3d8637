package remote_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// corpus is the Go source tree ingested once per test binary (benchmarks run their
// function more than once, and ingesting 11k files is the slow part of set-up).
var corpus struct {
	once  sync.Once
	dir   string
	store *casstore.Store
	root  casstore.Hash
	total int64
	n     int
	err   error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if corpus.dir != "" {
		os.RemoveAll(corpus.dir)
	}
	os.Exit(code)
}

// goTree returns the Go source tree ingested into a store, its total size and its
// number of distinct objects.
func goTree(b *testing.B, _ *s3test.Server) (*casstore.Store, casstore.Hash, int64, int) {
	b.Helper()
	src := filepath.Join(runtime.GOROOT(), "src")
	if _, err := os.Stat(src); err != nil {
		b.Skipf("Go source tree not available: %v", err)
	}
	corpus.once.Do(func() {
		if corpus.dir, corpus.err = os.MkdirTemp("", "tidepool-remote-bench-"); corpus.err != nil {
			return
		}
		if corpus.store, corpus.err = casstore.Open(filepath.Join(corpus.dir, "cas")); corpus.err != nil {
			return
		}
		corpus.root, _, corpus.err = ingest.Dir(context.Background(), corpus.store, src, ingest.Options{})
	})
	if corpus.err != nil {
		b.Fatal(corpus.err)
	}
	s := corpus.store
	var total int64
	n := 0
	seen := map[casstore.Hash]bool{}
	var walk func(h casstore.Hash)
	walk = func(h casstore.Hash) {
		if seen[h] {
			return
		}
		seen[h] = true
		n++
		sz, _ := s.Size(h)
		total += sz
		t, err := s.ReadTree(h)
		if err != nil {
			b.Fatal(err)
		}
		for _, e := range t {
			if e.Mode.IsDir() {
				walk(e.Hash)
			} else if !seen[e.Hash] {
				seen[e.Hash] = true
				n++
				sz, _ := s.Size(e.Hash)
				total += sz
			}
		}
	}
	walk(corpus.root)
	return s, corpus.root, total, n
}

func benchRemote(b *testing.B, srv *s3test.Server) *remote.Remote {
	r, err := remote.Open(remote.Config{URL: "s3://" + srv.Bucket + "/bench", Endpoint: srv.Endpoint()})
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// BenchmarkPullGoTree: pull of the Go source tree (every object, verified, stored
// durably) into an empty store, against the bandwidth baseline of one GET of a
// single object of the same total size from the same MinIO. Goal: >= 0.5x. The pull
// reads the push's pack and returns once its journal is synced: the root is durable
// and readable through the store then (pull-MB/s, the goal's ratio). The pack holds
// the objects that compress as LZ4 blocks, so it is smaller than the tree (pack-MB;
// pack-read-MB/s is the pack's bytes over the pull's time): the baseline is still
// the bandwidth for the tree's size in raw bytes. Its objects
// reach their names in the background; the time until they are all in place, synced,
// in the size index and the journal gone (Store.Settle) is reported beside it
// (settle-after-pull-ms, in-place-MB/s), outside the timed pull and finished before
// the next iteration starts. The same pull without packs (one GET per object) and
// plain parallel GETs that store nothing are reported too.
func BenchmarkPullGoTree(b *testing.B) {
	srv := s3test.Start(b)
	ctx := context.Background()
	s, root, total, n := goTree(b, srv)
	r := benchRemote(b, srv)
	if _, err := r.Push(ctx, s, root, remote.PushOptions{Ref: "main"}); err != nil {
		b.Fatal(err)
	}
	c := srv.Client(b)
	pack, err := c.StatObject(ctx, srv.Bucket, "bench/"+remote.PackPath(root), minio.StatObjectOptions{})
	if err != nil {
		b.Fatal(err)
	}
	big := make([]byte, total)
	rand.Read(big)
	if _, err := c.PutObject(ctx, srv.Bucket, "baseline", bytes.NewReader(big), total, minio.PutObjectOptions{}); err != nil {
		b.Fatal(err)
	}
	big = nil
	b.Logf("corpus: %d objects, %.1f MB; its pack: %.1f MB", n, float64(total)/1e6, float64(pack.Size)/1e6)
	// A second baseline: the same objects fetched by plain parallel GETs that store
	// nothing, which is what the server can do per object on this machine.
	keys := make([]string, 0, n)
	for o := range c.ListObjects(ctx, srv.Bucket, minio.ListObjectsOptions{Prefix: "bench/blobs/", Recursive: true}) {
		keys = append(keys, o.Key)
	}
	rawStart := time.Now()
	work := make(chan string)
	var wg sync.WaitGroup
	for w := 0; w < remote.DefaultConcurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range work {
				obj, err := c.GetObject(ctx, srv.Bucket, k, minio.GetObjectOptions{})
				if err == nil {
					io.Copy(io.Discard, obj)
					obj.Close()
				}
			}
		}()
	}
	for _, k := range keys {
		work <- k
	}
	close(work)
	wg.Wait()
	rawDur := time.Since(rawStart)
	// And a pull in LunarFS's layout alone (no packs: one GET per object), once.
	nr, err := remote.Open(remote.Config{URL: "s3://" + srv.Bucket + "/bench", Endpoint: srv.Endpoint(), NoPacks: true})
	if err != nil {
		b.Fatal(err)
	}
	dst, err := casstore.Open(filepath.Join(b.TempDir(), "cas"))
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	if _, err := nr.Pull(ctx, dst, root); err != nil {
		b.Fatal(err)
	}
	dst.Settle()
	noPackDur := time.Since(start)
	os.RemoveAll(dst.Root())
	syncFS(b, filepath.Dir(dst.Root()))
	var pullDur, getDur, settleDur time.Duration
	var requests, packs int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		dst, err := casstore.Open(filepath.Join(b.TempDir(), "cas"))
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		obj, err := c.GetObject(ctx, srv.Bucket, "baseline", minio.GetObjectOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if got, err := io.Copy(io.Discard, obj); err != nil || got != total {
			b.Fatalf("baseline GET: %d bytes, %v", got, err)
		}
		obj.Close()
		getDur += time.Since(start)
		start = time.Now()
		res, err := r.Pull(ctx, dst, root)
		if err != nil {
			b.Fatal(err)
		}
		pullDur += time.Since(start)
		if res.Objects+res.Present != int64(n) || res.Present > 1 { // H("") is made locally
			b.Fatalf("pulled %d objects (%d present), want %d", res.Objects, res.Present, n)
		}
		requests += res.Requests
		packs += res.Packs
		b.StopTimer()
		start = time.Now()
		dst.Settle()
		settleDur += time.Since(start)
		os.RemoveAll(dst.Root())
		syncFS(b, filepath.Dir(dst.Root())) // the removal's writeback and discards are not the next pull's
		b.StartTimer()
	}
	floor := layoutFloor(b, s)
	pullMBs := float64(total) * float64(b.N) / 1e6 / pullDur.Seconds()
	getMBs := float64(total) * float64(b.N) / 1e6 / getDur.Seconds()
	b.ReportMetric(pullMBs, "pull-MB/s")
	b.ReportMetric(getMBs, "single-GET-MB/s")
	b.ReportMetric(pullMBs/getMBs, "x-of-single-GET(goal>=0.5)")
	placedMBs := float64(total) * float64(b.N) / 1e6 / (pullDur + settleDur).Seconds()
	b.ReportMetric(settleDur.Seconds()*1000/float64(b.N), "settle-after-pull-ms")
	b.ReportMetric(placedMBs, "in-place-MB/s")
	b.ReportMetric(placedMBs/getMBs, "in-place-x-of-single-GET")
	floorMBs := float64(total) / 1e6 / floor.Seconds()
	b.ReportMetric(floorMBs, "layout-floor-MB/s")
	b.ReportMetric(floorMBs/getMBs, "layout-floor-x-of-single-GET")
	b.ReportMetric(float64(n)*float64(b.N)/pullDur.Seconds(), "objects/s")
	b.ReportMetric(float64(len(keys))/rawDur.Seconds(), "plain-parallel-GET-objects/s")
	b.ReportMetric(float64(total)/1e6/noPackDur.Seconds(), "no-pack-pull-MB/s")
	b.ReportMetric(float64(pack.Size)/1e6, "pack-MB")
	b.ReportMetric(float64(pack.Size)*float64(b.N)/1e6/pullDur.Seconds(), "pack-read-MB/s")
	b.ReportMetric(float64(requests)/float64(b.N), "requests/pull")
	b.ReportMetric(float64(packs)/float64(b.N), "packs/pull")
}

// BenchmarkPushSmallCommit: push after a commit that changed ten files in ten
// directories of the Go tree, against the full push of the tree: requests made (goal
// <= 3 per changed path component) and time.
func BenchmarkPushSmallCommit(b *testing.B) {
	srv := s3test.Start(b)
	ctx := context.Background()
	s, root, _, _ := goTree(b, srv)
	changed := []string{"fmt/print.go", "errors/errors.go", "os/file.go", "net/http/server.go", "strings/strings.go",
		"bytes/buffer.go", "io/io.go", "sort/sort.go", "time/time.go", "encoding/json/encode.go"}
	var fullDur, smallDur time.Duration
	var fullReq, smallReq, components int64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		r, err := remote.Open(remote.Config{URL: "s3://" + srv.Bucket + "/push-" + time.Now().Format("150405.000000"), Endpoint: srv.Endpoint()})
		if err != nil {
			b.Fatal(err)
		}
		upper := b.TempDir()
		for _, p := range changed {
			full := filepath.Join(upper, p)
			os.MkdirAll(filepath.Dir(full), 0o755)
			if err := os.WriteFile(full, []byte(time.Now().String()+p), 0o644); err != nil {
				b.Fatal(err)
			}
		}
		r1, err := ingest.Upper(ctx, s, root, upper, "", ingest.Options{})
		if err != nil {
			b.Fatal(err)
		}
		components = int64(countNew(b, s, root, r1))
		b.StartTimer()
		start := time.Now()
		full, err := r.Push(ctx, s, root, remote.PushOptions{Ref: "main"})
		if err != nil {
			b.Fatal(err)
		}
		fullDur += time.Since(start)
		fullReq += full.Requests
		start = time.Now()
		small, err := r.Push(ctx, s, r1, remote.PushOptions{Ref: "main", Expect: &root})
		if err != nil {
			b.Fatal(err)
		}
		smallDur += time.Since(start)
		smallReq += small.Requests
	}
	nb := float64(b.N)
	b.ReportMetric(float64(smallReq)/nb, "requests")
	b.ReportMetric(float64(smallReq)/nb/float64(components), "requests/changed-component(goal<=3)")
	b.ReportMetric(float64(fullReq)/nb, "full-push-requests")
	b.ReportMetric(smallDur.Seconds()/nb*1000, "ms")
	b.ReportMetric(fullDur.Seconds()/nb*1000, "full-push-ms")
	b.ReportMetric(smallDur.Seconds()/fullDur.Seconds(), "x-of-full-push-time")
}

// countNew counts the objects reachable from r1 and not from r0.
func countNew(b *testing.B, s *casstore.Store, r0, r1 casstore.Hash) int {
	old := map[casstore.Hash]bool{}
	var walk func(h casstore.Hash, into map[casstore.Hash]bool)
	walk = func(h casstore.Hash, into map[casstore.Hash]bool) {
		into[h] = true
		t, err := s.ReadTree(h)
		if err != nil {
			b.Fatal(err)
		}
		for _, e := range t {
			if e.Mode.IsDir() {
				if !into[e.Hash] {
					walk(e.Hash, into)
				}
			} else {
				into[e.Hash] = true
			}
		}
	}
	walk(r0, old)
	cur := map[casstore.Hash]bool{}
	walk(r1, cur)
	n := 0
	for h := range cur {
		if !old[h] {
			n++
		}
	}
	return n
}

// layoutFloor is what any pull into LunarFS's local layout costs on this machine
// before it fetches or verifies a byte: the corpus's objects, already in memory,
// written as one file each under <hh>/<62 hex> (temp file beside it and rename, 8
// writers) into an empty directory, then made durable with one syncfs: the cheapest
// crash-safe way to that layout. A pull cannot beat it.
func layoutFloor(b *testing.B, src *casstore.Store) time.Duration {
	b.Helper()
	type obj struct {
		rel  string
		data []byte
	}
	var objs []obj
	err := filepath.WalkDir(src.Root(), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p != src.Root() && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if !d.Type().IsRegular() || strings.HasPrefix(d.Name(), ".") {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src.Root(), p)
		objs = append(objs, obj{rel, data})
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	dir := filepath.Join(b.TempDir(), "floor")
	if err := os.Mkdir(dir, 0o700); err != nil {
		b.Fatal(err)
	}
	syncFS(b, dir)
	start := time.Now()
	for i := 0; i < 256; i++ {
		os.Mkdir(filepath.Join(dir, fmt.Sprintf("%02x", i)), 0o700)
	}
	work := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				// The temp file beside its final name: a rename within one directory
				// does not take the filesystem-wide lock a cross-directory one does.
				tmp := filepath.Join(dir, filepath.Dir(objs[i].rel), ".tmp"+strconv.Itoa(i))
				if err := os.WriteFile(tmp, objs[i].data, 0o600); err != nil {
					b.Error(err)
					continue
				}
				if err := os.Rename(tmp, filepath.Join(dir, objs[i].rel)); err != nil {
					b.Error(err)
				}
			}
		}()
	}
	for i := range objs {
		work <- i
	}
	close(work)
	wg.Wait()
	b.ReportMetric(float64(time.Since(start).Milliseconds()), "layout-floor-write-ms")
	syncFS(b, dir)
	took := time.Since(start)
	os.RemoveAll(dir)
	return took
}

// syncFS flushes the filesystem holding dir (syncfs), so that earlier work's
// writeback is not charged to what is timed next.
func syncFS(b *testing.B, dir string) {
	b.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		b.Fatal(err)
	}
}

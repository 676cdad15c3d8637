package kview

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// goTree ingests the Go source tree into a store once per benchmark (or uses the
// store and root given in TIDEPOOL_BENCH_STORE and TIDEPOOL_BENCH_ROOT).
func goTree(b *testing.B) (*casstore.Store, casstore.Hash) {
	b.Helper()
	if dir, root := os.Getenv("TIDEPOOL_BENCH_STORE"), os.Getenv("TIDEPOOL_BENCH_ROOT"); dir != "" && root != "" {
		s, err := casstore.Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		h, err := casstore.ParseHash(root)
		if err != nil {
			b.Fatal(err)
		}
		return s, h
	}
	s, err := casstore.Open(filepath.Join(b.TempDir(), "cas"))
	if err != nil {
		b.Fatal(err)
	}
	root, _, err := ingest.Dir(context.Background(), s, filepath.Join(runtime.GOROOT(), "src"), ingest.Options{})
	if err != nil {
		b.Fatal(err)
	}
	return s, root
}

// BenchmarkImageBuildGoTree builds the kernel view image of the Go source tree with
// the store warm, as the image cache does: scan (decode every tree, learn every
// file's size from the size index or a stat) and write the image file. Goal: 100 ms.
// stat-ed/op counts the sizes the index did not have (0 for a store whose objects
// all entered through Tidepool's batches).
func BenchmarkImageBuildGoTree(b *testing.B) {
	s, root := goTree(b)
	spec := Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000}
	dir := b.TempDir()
	var scan, write time.Duration
	var size int64
	var stated int
	cpu0 := cpuTime(b)
	for b.Loop() {
		t0 := time.Now()
		tr, err := Scan(context.Background(), s, spec)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		f, err := os.Create(filepath.Join(dir, "img.erofs"))
		if err != nil {
			b.Fatal(err)
		}
		if err := tr.WriteImage(f); err != nil {
			b.Fatal(err)
		}
		st, err := f.Stat()
		if err != nil {
			b.Fatal(err)
		}
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
		scan += t1.Sub(t0)
		write += time.Since(t1)
		size, stated = st.Size(), tr.Stated
	}
	b.ReportMetric(float64(scan.Microseconds())/1000/float64(b.N), "scan-ms/op")
	b.ReportMetric(float64(write.Microseconds())/1000/float64(b.N), "write-ms/op")
	b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/1000/float64(b.N), "cpu-ms/op")
	b.ReportMetric(float64(stated), "stat-ed/op")
	b.ReportMetric(float64(size)/(1<<20), "image-MiB")
}

// BenchmarkImageBuildAfterIdle builds the Go source tree's image as BenchmarkImageBuildGoTree
// does, each time after the process handed its free memory back to the kernel (as
// the Go runtime's scavenger does within seconds of a build, so before the next
// container's): fresh, in new memory, against kept, in the scratch of the builds
// before (scratch.go), as the image cache builds. faults/op counts the page faults
// a build takes; each costs about 15 µs on a VM with nested paging, under 1 µs on
// bare metal. Goal: kept takes a small fraction of fresh's faults.
func BenchmarkImageBuildAfterIdle(b *testing.B) {
	s, root := goTree(b)
	spec := Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000}
	dir := b.TempDir()
	var pool scratchPool
	afterIdle(b, nil, func(b *testing.B, kept bool) {
		sc := &scratch{}
		if kept {
			sc = pool.get()
		}
		tr, err := scan(context.Background(), s, spec, nil, sc)
		if err != nil {
			b.Fatal(err)
		}
		f, err := os.Create(filepath.Join(dir, "img.erofs"))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := tr.writeImage(f, sc); err != nil {
			b.Fatal(err)
		}
		f.Close()
		pool.put(sc)
	})
}

// afterIdle runs op as two sub-benchmarks, fresh (kept false) then kept, each op after
// idle (untimed, if not nil) and debug.FreeOSMemory, and reports the page faults an op
// takes and kept's faults and time against fresh's.
func afterIdle(b *testing.B, idle func(kept bool), op func(b *testing.B, kept bool)) {
	var freshFaults, freshTime float64
	for _, kept := range []bool{false, true} {
		b.Run(map[bool]string{false: "fresh", true: "kept"}[kept], func(b *testing.B) {
			var n int64
			for b.Loop() {
				b.StopTimer()
				if idle != nil {
					idle(kept)
				}
				debug.FreeOSMemory()
				b.StartTimer()
				f0 := minorFaults(b)
				op(b, kept)
				n += minorFaults(b) - f0
			}
			faults, perOp := float64(n)/float64(b.N), float64(b.Elapsed())/float64(b.N)
			b.ReportMetric(faults, "faults/op")
			if !kept {
				freshFaults, freshTime = faults, perOp
			} else if freshFaults > 0 {
				b.ReportMetric(faults/freshFaults, "faults-x-vs-fresh")
				b.ReportMetric(perOp/freshTime, "x-vs-fresh")
			}
		})
	}
}

// minorFaults is how many page faults this process has taken that read no disk.
func minorFaults(b *testing.B) int64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru.Minflt
}

// BenchmarkImageBuildSharedTrees builds images of the Go source tree for a new owner
// each time (so a new image) in one cache, as tidepoold does for forks that share
// trees (other owners, a commit's new root): tree objects come from the memo of
// decoded trees, file sizes still from the size index.
func BenchmarkImageBuildSharedTrees(b *testing.B) {
	s, root := goTree(b)
	memo := newTreeMemo(defaultMemoEntries)
	if _, err := scan(context.Background(), s, Spec{Root: root}, memo, &scratch{}); err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	i := 0
	cpu0 := cpuTime(b)
	for b.Loop() {
		i++
		tr, err := scan(context.Background(), s, Spec{Root: root, Prefix: "app", UID: uint32(i), GID: uint32(i)}, memo, &scratch{})
		if err != nil {
			b.Fatal(err)
		}
		f, err := os.Create(filepath.Join(dir, "img.erofs"))
		if err != nil {
			b.Fatal(err)
		}
		if err := tr.WriteImage(f); err != nil {
			b.Fatal(err)
		}
		f.Close()
	}
	b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/1000/float64(b.N), "cpu-ms/op")
}

// cpuTime is the CPU time (user and system, all threads) this process has used: on
// a machine shared with other work, wall time says more about the load than about
// the build.
func cpuTime(b *testing.B) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cachedGoTree is a cache holding the Go source tree's image at "app" for 1000:1000.
func cachedGoTree(b *testing.B) (*Cache, casstore.Hash) {
	s, root := goTree(b)
	c := openCache(b, b.TempDir(), s)
	if _, err := c.image(context.Background(), Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000}); err != nil {
		b.Fatal(err)
	}
	return c, root
}

// BenchmarkImageDeriveGoTree derives the image of the Go source tree for a new owner
// each time from the cached image of the first owner, as the cache does for a view of
// a cached tree for another owner: the object check of a cache hit (skipped here, as
// in tidepoold while the size index forgets nothing: BenchmarkImageCacheHitGoTree), a
// copy of the image with its owned inodes' owner rewritten, and the writes.
func BenchmarkImageDeriveGoTree(b *testing.B) {
	c, root := cachedGoTree(b)
	ctx := context.Background()
	i := uint32(0)
	cpu0 := cpuTime(b)
	for b.Loop() {
		i++
		if _, err := c.image(ctx, Spec{Root: root, Prefix: "app", UID: 2000 + i, GID: 2000 + i}); err != nil {
			b.Fatal(err)
		}
	}
	if d := c.stats.Derived.Load(); d != int64(i) {
		b.Fatalf("%d of %d images derived", d, i)
	}
	b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/1000/float64(b.N), "cpu-ms/op")
}

// BenchmarkImageDeriveAfterIdle is BenchmarkImageDeriveGoTree after the process handed
// its free memory back to the kernel (see BenchmarkImageBuildAfterIdle): fresh, with
// the cache's kept scratch dropped first (as scratchIdle after its last build), against
// kept. Goal: kept takes a small fraction of fresh's faults.
func BenchmarkImageDeriveAfterIdle(b *testing.B) {
	c, root := cachedGoTree(b)
	i := uint32(0)
	afterIdle(b, func(kept bool) {
		if !kept {
			c.scratch.drop()
		}
	}, func(b *testing.B, kept bool) {
		i++
		derived := c.stats.Derived.Load()
		if _, err := c.image(context.Background(), Spec{Root: root, Prefix: "app", UID: 2000 + i, GID: 2000 + i}); err != nil {
			b.Fatal(err)
		}
		if c.stats.Derived.Load() != derived+1 {
			b.Fatal("the image was not derived")
		}
	})
}

// BenchmarkImageCacheHitGoTree is a cache hit on the image of the Go source tree, as
// every container on a cached tree makes: checked looks every file's object up (the
// size index has all 11.5k), as a hit does in a new process or once the index has
// forgotten an entry; skipped is a hit whose list the index showed whole at its
// current epoch (checked.go). A hot loop: in tidepoold, between containers, the
// lookups miss the CPU's caches and cost more.
func BenchmarkImageCacheHitGoTree(b *testing.B) {
	c, root := cachedGoTree(b)
	ctx := context.Background()
	spec := Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000}
	for _, mode := range []string{"checked", "skipped"} {
		b.Run(mode, func(b *testing.B) {
			checks := c.stats.ObjectChecks.Load()
			n := int64(0)
			for b.Loop() {
				n++
				if mode == "checked" {
					c.checked.drop(spec.Key())
				}
				if _, err := c.image(ctx, spec); err != nil {
					b.Fatal(err)
				}
			}
			want := n
			if mode == "skipped" {
				want = 0
			}
			if got := c.stats.ObjectChecks.Load() - checks; got != want {
				b.Fatalf("%s: %d of %d hits checked their objects, want %d", mode, got, n, want)
			}
		})
	}
}

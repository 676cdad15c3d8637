package kview

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

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
	b.ReportMetric(float64(stated), "stat-ed/op")
	b.ReportMetric(float64(size)/(1<<20), "image-MiB")
}

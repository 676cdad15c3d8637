package kview

import (
	"context"
	"io"
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

// nullSeeker is an io.WriteSeeker that keeps only the size.
type nullSeeker struct{ off, size int64 }

func (w *nullSeeker) Write(p []byte) (int, error) {
	w.off += int64(len(p))
	w.size = max(w.size, w.off)
	return len(p), nil
}

func (w *nullSeeker) Seek(off int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
		w.off = off
	case io.SeekCurrent:
		w.off += off
	case io.SeekEnd:
		w.off = w.size + off
	}
	return w.off, nil
}

// BenchmarkImageBuildGoTree builds the kernel view image of the Go source tree with
// the store warm: scan (decode every tree, stat every object) and write. Goal: 100 ms.
func BenchmarkImageBuildGoTree(b *testing.B) {
	s, root := goTree(b)
	spec := Spec{Root: root, Prefix: "app", UID: 1000, GID: 1000}
	var scan, write time.Duration
	var size int64
	for b.Loop() {
		t0 := time.Now()
		tr, err := Scan(context.Background(), s, spec)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		w := &nullSeeker{}
		if err := tr.WriteImage(w); err != nil {
			b.Fatal(err)
		}
		scan += t1.Sub(t0)
		write += time.Since(t1)
		size = w.size
	}
	b.ReportMetric(float64(scan.Milliseconds())/float64(b.N), "scan-ms/op")
	b.ReportMetric(float64(write.Milliseconds())/float64(b.N), "write-ms/op")
	b.ReportMetric(float64(size)/(1<<20), "image-MiB")
}

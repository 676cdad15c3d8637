package fuse

import (
	"context"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
)

// readTree walks dir and reads every regular file to the end, as grep -r or tar
// would, and returns the bytes read.
func readTree(tb testing.TB, dir string, buf []byte) int64 {
	var total int64
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		n, err := io.CopyBuffer(io.Discard, onlyReader{f}, buf)
		f.Close()
		total += n
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	return total
}

// onlyReader hides WriterTo/ReaderFrom so both sides read through the same buffer.
type onlyReader struct{ io.Reader }

func dropCaches(tb testing.TB) {
	tb.Helper()
	unixSync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200); err != nil {
		tb.Skipf("cannot drop caches: %v", err)
	}
}

func unixSync() { _ = exec.Command("sync").Run() }

// BenchmarkReadGoTree reads the whole Go source tree through a view and, in the same
// iterations, from the native filesystem; ns/op is the view, x-vs-native the ratio.
// The modes: passthrough (the default), plain (reads through the server) and noopen
// (Options.NoOpen: no request per open, pages cached by the view).
func BenchmarkReadGoTree(b *testing.B) {
	requireRoot(b)
	s, root := goStore(b)
	for _, c := range []struct {
		name        string
		cold        bool
		passthrough bool
		noOpen      bool
	}{
		{"warm/passthrough", false, true, false},
		{"warm/plain", false, false, false},
		{"warm/noopen", false, false, true},
		{"cold/passthrough", true, true, false},
		{"cold/plain", true, false, false},
		{"cold/noopen", true, false, true},
	} {
		b.Run(c.name, func(b *testing.B) {
			v := mount(b, s, root, Options{DisablePassthrough: !c.passthrough, NoOpen: c.noOpen})
			if c.passthrough && !v.PassthroughActive() {
				b.Skip("passthrough unavailable")
			}
			if c.noOpen && !v.NoOpenActive() {
				b.Skip("kernel lacks no-open support")
			}
			buf := make([]byte, 256<<10)
			size := readTree(b, goSrc, buf)
			if got := readTree(b, v.Dir(), buf); got != size {
				b.Fatalf("view read %d bytes, native %d", got, size)
			}
			reads, opens := v.Stats().Reads.Load(), v.Stats().Opens.Load()
			b.SetBytes(size)
			var native, view time.Duration
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				if c.cold {
					dropCaches(b)
				}
				start := time.Now()
				readTree(b, goSrc, buf)
				native += time.Since(start)
				if c.cold {
					dropCaches(b)
				}
				b.StartTimer()
				start = time.Now()
				readTree(b, v.Dir(), buf)
				view += time.Since(start)
			}
			b.StopTimer()
			b.ReportMetric(float64(native.Milliseconds())/float64(b.N), "native-ms/op")
			b.ReportMetric(view.Seconds()/native.Seconds(), "x-vs-native")
			b.ReportMetric(float64(v.Stats().Reads.Load()-reads)/float64(b.N), "READs/op")
			b.ReportMetric(float64(v.Stats().Opens.Load()-opens)/float64(b.N), "OPENs/op")
		})
	}
}

// BenchmarkMountGoTree times mounting a view of the Go tree (ready to serve: the
// kernel handshake done) against copying the tree with cp -a, measured once in the
// same run, and against mounting a one-file tree, to show mount cost does not depend
// on tree size.
func BenchmarkMountGoTree(b *testing.B) {
	requireRoot(b)
	s, root := goStore(b)
	tiny, err := s.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "x", Hash: casstore.EmptyHash}})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := s.PutBytes(nil); err != nil {
		b.Fatal(err)
	}
	readTree(b, goSrc, make([]byte, 256<<10)) // warm the source for cp
	dst := filepath.Join(b.TempDir(), "copy")
	start := time.Now()
	if out, err := exec.Command("cp", "-a", goSrc, dst).CombinedOutput(); err != nil {
		b.Fatalf("cp -a: %v\n%s", err, out)
	}
	cp := time.Since(start)
	os.RemoveAll(dst)

	dir := sharedDir(b)
	mountOnce := func(h casstore.Hash) time.Duration {
		start := time.Now()
		v, err := Mount(context.Background(), s, h, dir, Options{})
		d := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if err := v.Unmount(); err != nil {
			b.Fatal(err)
		}
		return d
	}
	var goTotal, tinyTotal time.Duration
	b.ResetTimer()
	for i := range b.N {
		// Alternate the order, so neither tree always follows the other's unmount.
		if i%2 == 0 {
			b.StopTimer()
			tinyTotal += mountOnce(tiny)
			b.StartTimer()
			goTotal += mountOnce(root)
		} else {
			goTotal += mountOnce(root)
			b.StopTimer()
			tinyTotal += mountOnce(tiny)
			b.StartTimer()
		}
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(goTotal.Seconds()*1000/n, "mount-ms")
	b.ReportMetric(cp.Seconds()*1000, "cp-a-ms")
	b.ReportMetric(goTotal.Seconds()/cp.Seconds()/n, "x-vs-cp")
	b.ReportMetric(goTotal.Seconds()/tinyTotal.Seconds(), "x-vs-tiny-tree")
}

// BenchmarkReadLargeFiles reads 256 MiB in eight 32 MiB files through a view and
// natively, warm: with passthrough the kernel reads the object files directly, and
// with NoOpen from the view's own page cache, so throughput should match the native
// filesystem.
func BenchmarkReadLargeFiles(b *testing.B) {
	requireRoot(b)
	src := b.TempDir()
	chunk := make([]byte, 1<<20)
	for i := range 8 {
		f, err := os.Create(filepath.Join(src, "blob"+string(rune('0'+i))))
		if err != nil {
			b.Fatal(err)
		}
		for j := range 32 {
			for k := range chunk {
				chunk[k] = byte(i*131 + j*7 + k*13)
			}
			if _, err := f.Write(chunk); err != nil {
				b.Fatal(err)
			}
		}
		f.Close()
	}
	s := newStore(b)
	root := ingestTree(b, s, src)
	for _, c := range []struct {
		name string
		opts Options
	}{
		{"passthrough", Options{}},
		{"plain", Options{DisablePassthrough: true}},
		{"noopen", Options{NoOpen: true}},
	} {
		b.Run(c.name, func(b *testing.B) {
			v := mount(b, s, root, c.opts)
			buf := make([]byte, 256<<10)
			size := readTree(b, src, buf)
			readTree(b, v.Dir(), buf)
			b.SetBytes(size)
			var native, view time.Duration
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				start := time.Now()
				readTree(b, src, buf)
				native += time.Since(start)
				b.StartTimer()
				start = time.Now()
				readTree(b, v.Dir(), buf)
				view += time.Since(start)
			}
			b.StopTimer()
			b.ReportMetric(float64(native.Milliseconds())/float64(b.N), "native-ms/op")
			b.ReportMetric(view.Seconds()/native.Seconds(), "x-vs-native")
		})
	}
}

package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// timeToFirstByte runs ctr with args and returns how long until the container's
// first output byte arrived, and how long the whole command took.
func timeToFirstByte(b *testing.B, s *stack.Stack, args ...string) (first, total time.Duration) {
	b.Helper()
	cmd := exec.Command(ctrPath(b), append([]string{"--address", s.C.Address, "--namespace", s.C.Namespace}, args...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	r := bufio.NewReader(out)
	if _, err := r.ReadByte(); err != nil {
		werr := cmd.Wait()
		b.Fatalf("no output from ctr %v: %v (ctr: %v)\nctr's stderr: %s\n%s", args, err, werr, stderr.Bytes(), s.Daemon.LogTail(20))
	}
	first = time.Since(start)
	r.WriteTo(discard{})
	if err := cmd.Wait(); err != nil {
		b.Fatalf("ctr %v: %v\nctr's stderr: %s", args, err, stderr.Bytes())
	}
	return first, time.Since(start)
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func ctrPath(b testing.TB) string {
	p, err := testenv.Tool("ctr")
	if err != nil {
		b.Fatal(err)
	}
	return p
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// BenchmarkRunWithFork: `ctr run --rm` of a trivial command with the tidepool
// snapshotter and a fork of the Go source tree, against the overlayfs snapshotter
// without a fork, same image; and the time from `ctr run` to the first byte the
// container reads from a source file (fork) or an image file (baseline).
// Goal: within 1.2x of plain overlayfs whatever the tree's size.
func BenchmarkRunWithFork(b *testing.B) {
	s := stack.Start(b, stack.Options{})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool", "overlayfs")
	root := s.Ingest(b, filepath.Join(runtime.GOROOT(), "src"))
	var forkFirst, forkTotal, baseFirst, baseTotal []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		f, t := timeToFirstByte(b, s, append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/src")...),
			imagebuild.BusyboxRef, fmt.Sprintf("fork-%d", i), "head", "-c", "64", "/src/go/build/build.go")...)
		forkFirst, forkTotal = append(forkFirst, f), append(forkTotal, t)
		f, t = timeToFirstByte(b, s, "run", "--rm", "--fifo-dir", s.C.FIFODir, "--snapshotter", "overlayfs",
			imagebuild.BusyboxRef, fmt.Sprintf("base-%d", i), "head", "-c", "64", "/etc/passwd")
		baseFirst, baseTotal = append(baseFirst, f), append(baseTotal, t)
	}
	b.StopTimer()
	b.ReportMetric(float64(median(forkTotal).Microseconds())/1000, "fork-run-ms")
	b.ReportMetric(float64(median(baseTotal).Microseconds())/1000, "overlayfs-run-ms")
	b.ReportMetric(float64(median(forkTotal))/float64(median(baseTotal)), "run-x-vs-overlayfs")
	b.ReportMetric(float64(median(forkFirst).Microseconds())/1000, "fork-first-byte-ms")
	b.ReportMetric(float64(median(baseFirst).Microseconds())/1000, "overlayfs-first-byte-ms")
	b.ReportMetric(float64(median(forkFirst))/float64(median(baseFirst)), "first-byte-x-vs-overlayfs")
}

// BenchmarkShimOverhead: `ctr run --rm` through containerd-shim-tidepool-v1 against
// io.containerd.runc.v2, same image and snapshotter. Goal: within 1.05x.
func BenchmarkShimOverhead(b *testing.B) {
	s := stack.Start(b, stack.Options{})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool")
	flags := shimFlags(b, s, "")
	var ours, runc []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_, t := timeToFirstByte(b, s, append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, flags...),
			imagebuild.BusyboxRef, fmt.Sprintf("tp-%d", i), "echo", "x")...)
		ours = append(ours, t)
		_, t = timeToFirstByte(b, s, "run", "--rm", "--fifo-dir", s.C.FIFODir, "--runtime", "io.containerd.runc.v2", "--snapshotter", "tidepool",
			imagebuild.BusyboxRef, fmt.Sprintf("rc-%d", i), "echo", "x")
		runc = append(runc, t)
	}
	b.StopTimer()
	b.ReportMetric(float64(median(ours).Microseconds())/1000, "tidepool-shim-ms")
	b.ReportMetric(float64(median(runc).Microseconds())/1000, "runc-shim-ms")
	b.ReportMetric(float64(median(ours))/float64(median(runc)), "x-vs-runc-shim")
}

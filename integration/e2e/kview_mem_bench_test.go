package e2e

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/kview"
)

// rssKiB reads a process's resident set size.
func rssKiB(b *testing.B, pid int) int64 {
	b.Helper()
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for _, l := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatal("no VmRSS")
	return 0
}

// BenchmarkDaemonMemoryPerView: tidepoold's RSS with 200 fork views of one tree
// mounted (snapshots prepared through its snapshotter API) against none, for kernel
// and FUSE views: in the first round (first-KiB-per-view) and in the last. Goal
// (kernel): < 64 KiB per view.
func BenchmarkDaemonMemoryPerView(b *testing.B) {
	const n = 200
	for _, mode := range []string{"kernel", "fuse"} {
		b.Run(mode, func(b *testing.B) {
			if mode == "kernel" {
				if err := kview.Probe(b.TempDir()); err != nil {
					b.Skip(err)
				}
			}
			b.Setenv("TIDEPOOL_VIEWS_MODE", mode)
			s := stack.Start(b, stack.Options{})
			root := s.Ingest(b, writeTree(b, appSource))
			conn, err := grpc.NewClient("unix://"+s.SnapAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "tidepool")
			ctx := context.Background()
			var perView, first float64
			for i := 0; i < b.N; i++ {
				before := rssKiB(b, s.Daemon.Pid())
				keys := make([]string, n)
				for j := range keys {
					keys[j] = fmt.Sprintf("mem-%d-%d", i, j)
					if _, err := sn.Prepare(ctx, keys[j], "", snapshots.WithLabels(map[string]string{
						binding.LabelFork: root, binding.LabelDiscard: "true",
					})); err != nil {
						b.Fatal(err)
					}
				}
				after := rssKiB(b, s.Daemon.Pid())
				perView = float64(after-before) / n
				if i == 0 {
					first = perView
				}
				for _, k := range keys {
					if err := sn.Remove(ctx, k); err != nil {
						b.Fatal(err)
					}
				}
			}
			// The first round also counts the daemon's own warm-up (the image built
			// once, the fork database's pages first touched, gRPC buffers); later rounds
			// reuse what earlier ones freed.
			b.ReportMetric(first, "first-KiB-per-view")
			b.ReportMetric(perView, "KiB-per-view")
		})
	}
}

package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"
	"time"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/localapi"
)

// benchParentScript keeps 100 files under /src changed from the fork, rewriting
// all of them with new content every round, so every branch commits 100 files the
// store has not seen (the cold case), while the container keeps running.
const benchParentScript = `set -e; cd /src; mkdir -p gen; n=0
while :; do n=$((n+1)); i=0; while [ $i -lt 100 ]; do echo "round $n file $i" > gen/f$i.txt; i=$((i+1)); done; echo $n > /tmp/round; sleep 0.05; done`

func branchPercentile(ds []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(float64(len(s))*p+0.5) - 1
	if i < 0 {
		i = 0
	}
	if i >= len(s) {
		i = len(s) - 1
	}
	return s[i]
}

func branchMs(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// BenchmarkForkContainer: branch a running container with 100 changed files 3 ways,
// through the API (from this process) and through the CLI, against a plain
// `tidepool fork ROOT` through the same API and CLI in the same run (one record, no
// walk, no pause). Reports p50/p95 of each, and of the pause (how long the
// container was frozen) and tidepoold's own time. Goal: fork --container p95 <= 50 ms,
// the container paused only for the walk. 20 branches per iteration.
func BenchmarkForkContainer(b *testing.B) {
	s := stack.Start(b, stack.Options{})
	s.C.ImportImage(b, imagebuild.BusyboxArchive(b).Path, imagebuild.BusyboxRef, "tidepool")
	root := s.Ingest(b, writeTree(b, appSource))
	s.MustCtr(b, append(append([]string{"run", "-d", "--fifo-dir", s.C.FIFODir}, forkLabels(root, branchWorkdir)...),
		imagebuild.BusyboxRef, "parent", "sh", "-c", benchParentScript)...)
	b.Cleanup(func() {
		s.Ctr("task", "kill", "-s", "KILL", "parent")
		waitTaskGone(b, s, "parent")
		s.Ctr("container", "rm", "parent")
		waitViewsReleased(b, s)
	})
	proot := fmt.Sprintf("/proc/%d/root", taskPid(b, s, "parent"))
	waitFile(b, s, proot+"/tmp/round")
	client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	ctx := context.Background()
	base, err := casstore.ParseHash(root)
	if err != nil {
		b.Fatal(err)
	}
	tidepool := filepath.Join(s.Bin, "tidepool")
	cli := func(args ...string) time.Duration {
		start := time.Now()
		if out, err := exec.Command(tidepool, append([]string{"--root", s.Root}, args...)...).CombinedOutput(); err != nil {
			b.Fatalf("tidepool %v: %v\n%s", args, err, out)
		}
		return time.Since(start)
	}
	var apiFork, apiBase, cliFork, cliBase, paused, daemon, lookup, freeze, walk, publish, record []time.Duration
	d := func(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }
	var files int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 20; j++ {
			start := time.Now()
			res, err := client.ForkContainer(ctx, &apiv1.ForkContainerRequest{Namespace: s.C.Namespace, ContainerId: "parent", Count: 3})
			if err != nil {
				b.Fatal(err)
			}
			apiFork = append(apiFork, time.Since(start))
			paused, daemon = append(paused, d(res.GetPausedMs())), append(daemon, d(res.GetTotalMs()))
			lookup, freeze, walk = append(lookup, d(res.GetLookupMs())), append(freeze, d(res.GetFreezeMs())), append(walk, d(res.GetWalkMs()))
			publish, record = append(publish, d(res.GetPublishMs())), append(record, d(res.GetRecordMs()))
			files = res.GetFiles()

			start = time.Now()
			if _, err := client.Create(ctx, forks.CreateRequest{Base: base}); err != nil {
				b.Fatal(err)
			}
			apiBase = append(apiBase, time.Since(start))

			cliFork = append(cliFork, cli("fork", "--container", "parent", "--namespace", s.C.Namespace, "--count", "3"))
			cliBase = append(cliBase, cli("fork", root))
			time.Sleep(20 * time.Millisecond) // let the parent write a new round
		}
	}
	b.StopTimer()
	if files < 100 {
		b.Fatalf("branches committed %d files, want >= 100", files)
	}
	for _, m := range []struct {
		name string
		ds   []time.Duration
	}{
		{"api-fork-container", apiFork}, {"api-fork-root", apiBase},
		{"cli-fork-container", cliFork}, {"cli-fork-root", cliBase},
		{"paused", paused}, {"daemon", daemon}, {"lookup", lookup}, {"freeze", freeze}, {"walk", walk},
		{"publish", publish}, {"record", record},
	} {
		b.ReportMetric(branchMs(branchPercentile(m.ds, 0.5)), m.name+"-p50-ms")
		b.ReportMetric(branchMs(branchPercentile(m.ds, 0.95)), m.name+"-p95-ms")
	}
	b.ReportMetric(float64(branchPercentile(apiFork, 0.95))/float64(branchPercentile(apiBase, 0.95)), "api-p95-x-vs-fork-root")
	b.ReportMetric(float64(branchPercentile(cliFork, 0.95))/float64(branchPercentile(cliBase, 0.95)), "cli-p95-x-vs-fork-root")
}

package ingest

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// goSrc is the real source tree the benchmarks use: the Go toolchain's own sources.
func goSrc(b *testing.B) string {
	b.Helper()
	dir := filepath.Join(runtime.GOROOT(), "src")
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		b.Skipf("no Go source tree at %s", dir)
	}
	return dir
}

// regularFiles lists the files Dir would read under root, sorted.
func regularFiles(b *testing.B, root string) (files []string, bytes int64) {
	b.Helper()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Name() == ".git" {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			files = append(files, p)
			bytes += info.Size()
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	sort.Strings(files)
	return files, bytes
}

// commitSetup is an overlay whose lower holds a tree at prefix "src", that tree
// ingested as the base, and files changed through the merged view.
type commitSetup struct {
	store   *casstore.Store
	base    casstore.Hash
	upper   string
	merged  string
	changed []string // files edited through the merged view
}

// newCommitSetup ingests tree (a directory named src) as the base, mounts an overlay
// over its parent and changes n files at scattered depths through the merged view.
func newCommitSetup(b *testing.B, tree string, n int) commitSetup {
	b.Helper()
	requireRoot(b)
	s := casstoretest.NewStore(b)
	base, _, err := Dir(b.Context(), s, tree, Options{})
	if err != nil {
		b.Fatal(err)
	}
	// The tree's parent is the overlay's lower layer, so the tree sits at prefix "src".
	if filepath.Base(tree) != "src" {
		b.Fatalf("benchmark trees must be named src, got %s", tree)
	}
	parent := filepath.Dir(tree)
	tmp := b.TempDir()
	c := commitSetup{store: s, base: base, upper: filepath.Join(tmp, "upper"), merged: filepath.Join(tmp, "merged")}
	work := filepath.Join(tmp, "work")
	mkdirs(b, c.upper, work, c.merged)
	if err := mountOverlay(b, c.merged, []string{parent}, c.upper, work, ""); err != nil {
		b.Fatal(err)
	}
	files, _ := regularFiles(b, filepath.Join(c.merged, "src"))
	// Scattered: spread over the sorted list, which spreads them over directories and depths.
	for i := range n {
		c.changed = append(c.changed, files[(2*i+1)*len(files)/(2*n)])
	}
	c.edit(b, 0)
	return c
}

// edit appends a line to every changed file through the merged view (a copy-up the
// first time), so each round's commit has new content to store.
func (c *commitSetup) edit(b *testing.B, round int) {
	b.Helper()
	for i, f := range c.changed {
		fh, err := os.OpenFile(f, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			b.Fatal(err)
		}
		fmt.Fprintf(fh, "\n// changed by the commit benchmark: file %d, round %d\n", i, round)
		if err := fh.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// smallSrc writes a small source tree (200 files) named src.
func smallSrc(b *testing.B) string {
	b.Helper()
	dir := filepath.Join(b.TempDir(), "src")
	for i := range 200 {
		writeFile(b, filepath.Join(dir, fmt.Sprintf("pkg%d", i%10), fmt.Sprintf("sub%d", i%3), fmt.Sprintf("f%03d.go", i)),
			strings.Repeat(fmt.Sprintf("// line %d\n", i), 20), 0o644)
	}
	return dir
}

// BenchmarkCommit compares committing 10 changed files (Upper) with re-ingesting the
// whole merged Go tree (Dir), the baseline LunarFS's "commit" amounts to; and shows the
// commit's cost does not grow with the tree by committing the same number of changes
// over a 200-file tree. Every round edits the files again, so every commit stores new
// blobs and trees (and syncs them), as a real one does; the recommit metrics repeat
// each commit with nothing new to store, which leaves out the disk syncs (shared with
// whatever else the machine is writing) and shows the walk's own cost.
func BenchmarkCommit(b *testing.B) {
	goTree := newCommitSetup(b, goSrc(b), 10)
	small := newCommitSetup(b, smallSrc(b), 10)
	ctx := b.Context()
	var commitGo, commitSmall, reingest, againGo, againSmall time.Duration
	round := 0
	timed := func(d *time.Duration, fn func() casstore.Hash) casstore.Hash {
		t0 := time.Now()
		h := fn()
		*d += time.Since(t0)
		return h
	}
	upper := func(c commitSetup) func() casstore.Hash {
		return func() casstore.Hash {
			h, err := Upper(ctx, c.store, c.base, c.upper, "src", Options{})
			if err != nil {
				b.Fatal(err)
			}
			return h
		}
	}
	for b.Loop() {
		b.StopTimer()
		round++
		goTree.edit(b, round)
		small.edit(b, round)
		b.StartTimer()
		got := timed(&commitGo, upper(goTree))
		timed(&commitSmall, upper(small))
		// The same commits again: every object is already stored, so nothing is synced
		// and what is left is the walk of the upper and the trees on the changed paths.
		timed(&againGo, upper(goTree))
		timed(&againSmall, upper(small))
		want := timed(&reingest, func() casstore.Hash {
			h, _, err := Dir(ctx, goTree.store, filepath.Join(goTree.merged, "src"), Options{})
			if err != nil {
				b.Fatal(err)
			}
			return h
		})
		if got != want {
			b.Fatalf("commit %s != re-ingest %s", got, want)
		}
	}
	n := float64(b.N)
	b.ReportMetric(float64(commitGo.Nanoseconds())/n, "commit-go-ns")
	b.ReportMetric(float64(reingest.Nanoseconds())/n, "reingest-go-ns")
	b.ReportMetric(float64(reingest)/float64(commitGo), "x-vs-baseline")
	b.ReportMetric(float64(commitSmall.Nanoseconds())/n, "commit-small-ns")
	b.ReportMetric(float64(commitGo)/float64(commitSmall), "go-vs-small-commit")
	b.ReportMetric(float64(againGo.Nanoseconds())/n, "recommit-go-ns")
	b.ReportMetric(float64(againSmall.Nanoseconds())/n, "recommit-small-ns")
	b.ReportMetric(float64(againGo)/float64(againSmall), "go-vs-small-recommit")
}

// BenchmarkIngestThroughput compares Dir's throughput on the Go tree with `cat` of the
// same files to /dev/null (the cost of just reading them), page cache warm for both:
// into an empty store (hash, write and sync every object) and into a store that already
// holds them (hash only, the re-ingest case).
func BenchmarkIngestThroughput(b *testing.B) {
	tree := goSrc(b)
	files, total := regularFiles(b, tree)
	mb := float64(total) / 1e6
	cat := func() time.Duration {
		t0 := time.Now()
		for i := 0; i < len(files); i += 2000 {
			cmd := exec.Command("cat", files[i:min(i+2000, len(files))]...)
			devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
			if err != nil {
				b.Fatal(err)
			}
			cmd.Stdout = devnull
			err = cmd.Run()
			devnull.Close()
			if err != nil {
				b.Fatalf("cat: %v", err)
			}
		}
		return time.Since(t0)
	}
	cat() // warm the page cache for both sides
	warm := casstoretest.NewStore(b)
	if _, _, err := Dir(b.Context(), warm, tree, Options{}); err != nil {
		b.Fatal(err)
	}
	var tCat, tCold, tWarm time.Duration
	for b.Loop() {
		tCat += cat()

		b.StopTimer()
		dir, err := os.MkdirTemp("", "ingest-bench-")
		if err != nil {
			b.Fatal(err)
		}
		cold, err := casstore.Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		t0 := time.Now()
		if _, _, err := Dir(b.Context(), cold, tree, Options{}); err != nil {
			b.Fatal(err)
		}
		tCold += time.Since(t0)
		b.StopTimer()
		os.RemoveAll(dir)
		b.StartTimer()

		t0 = time.Now()
		if _, _, err := Dir(b.Context(), warm, tree, Options{}); err != nil {
			b.Fatal(err)
		}
		tWarm += time.Since(t0)
	}
	n := float64(b.N)
	rate := func(d time.Duration) float64 { return mb * n / d.Seconds() }
	b.ReportMetric(rate(tCat), "cat-MB/s")
	b.ReportMetric(rate(tCold), "ingest-new-MB/s")
	b.ReportMetric(rate(tWarm), "ingest-existing-MB/s")
	b.ReportMetric(rate(tWarm)/rate(tCat), "x-vs-baseline")
	b.ReportMetric(rate(tCold)/rate(tCat), "new-x-vs-baseline")
}

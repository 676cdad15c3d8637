package forks_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// goSrc is the benchmark corpus: the Go source tree (11.5k files, 157 MB) as a git
// repository with one commit, and ingested into a store.
type goSrc struct {
	repo  string
	store *casstore.Store
	root  casstore.Hash
}

// loadGoSrc builds the corpus once and caches it under os.TempDir(), keyed by a stamp
// of the Go installation, so repeated benchmark runs skip the minute of set-up.
func loadGoSrc(b *testing.B) goSrc {
	b.Helper()
	if _, err := exec.LookPath("git"); err != nil {
		b.Skip("git is not installed")
	}
	src := filepath.Join(runtime.GOROOT(), "src")
	fi, err := os.Stat(src)
	if err != nil {
		b.Skipf("Go source tree not available: %v", err)
	}
	stamp := casstore.Sum([]byte(fmt.Sprint(src, runtime.Version(), fi.ModTime().UnixNano(), "v1"))).Short()
	cache := filepath.Join(os.TempDir(), "tidepool-bench-gosrc-"+stamp)
	if _, err := os.Stat(filepath.Join(cache, "done")); err != nil {
		b.Logf("building the Go source corpus in %s (once per Go installation)", cache)
		build(b, src, cache)
	}
	rootHex, err := os.ReadFile(filepath.Join(cache, "root"))
	if err != nil {
		b.Fatal(err)
	}
	root, err := casstore.ParseHash(strings.TrimSpace(string(rootHex)))
	if err != nil {
		b.Fatal(err)
	}
	s, err := casstore.Open(filepath.Join(cache, "cas"))
	if err != nil {
		b.Fatal(err)
	}
	if ok, err := s.Has(root); err != nil || !ok {
		b.Fatalf("cached corpus %s lacks its root %s (%v); remove the directory", cache, root, err)
	}
	return goSrc{repo: filepath.Join(cache, "repo"), store: s, root: root}
}

// build makes the corpus in a scratch directory and renames it into place, so an
// interrupted build never leaves a half-made cache behind.
func build(b *testing.B, src, cache string) {
	tmp, err := os.MkdirTemp(filepath.Dir(cache), filepath.Base(cache)+".building-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	repo := filepath.Join(tmp, "repo")
	run := func(dir string, args ...string) {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	run(tmp, "cp", "-a", src, repo)
	run(repo, "git", "init", "-q")
	run(repo, "git", "add", "-A")
	run(repo, "git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-q", "-m", "go source")
	s, err := casstore.Open(filepath.Join(tmp, "cas"))
	if err != nil {
		b.Fatal(err)
	}
	root, _, err := ingest.Dir(context.Background(), s, src, ingest.Options{})
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, "root"), []byte(root.String()+"\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, "done"), nil, 0o644); err != nil {
		b.Fatal(err)
	}
	if err := os.Rename(tmp, cache); err != nil {
		if _, serr := os.Stat(filepath.Join(cache, "done")); serr != nil { // not a concurrent builder's win
			b.Fatal(err)
		}
	}
}

// fork is what `tidepool fork` does: check that the base exists, write one record.
func fork(b *testing.B, s *casstore.Store, db *forks.DB, root casstore.Hash) {
	if ok, err := s.Has(root); err != nil || !ok {
		b.Fatalf("base %s missing: %v", root, err)
	}
	if _, err := db.Create(context.Background(), forks.CreateRequest{Base: root, Label: "bench"}); err != nil {
		b.Fatal(err)
	}
}

func openBenchDB(b *testing.B) *forks.DB {
	db, err := forks.OpenDB(filepath.Join(b.TempDir(), "forks.db"), time.Second)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { db.Close() })
	return db
}

// forksPerOp is how many forks one benchmark iteration makes: a fork is too quick
// to time one at a time beside git, and fsync times vary.
const forksPerOp = 50

// BenchmarkForkVsWorktree compares a Tidepool fork of the Go source tree with the
// nearest git operation, `git worktree add --detach DIR HEAD` on a repository of the
// same tree. The baseline is git; x-vs-baseline is how many times faster the fork is.
func BenchmarkForkVsWorktree(b *testing.B) {
	corpus := loadGoSrc(b)
	db := openBenchDB(b)
	var forkTime, gitTime time.Duration
	scratch := b.TempDir()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		for j := 0; j < forksPerOp; j++ {
			fork(b, corpus.store, db, corpus.root)
		}
		forkTime += time.Since(start) / forksPerOp

		wt := filepath.Join(scratch, fmt.Sprint("wt", i))
		cmd := exec.Command("git", "worktree", "add", "-q", "--detach", wt, "HEAD")
		cmd.Dir = corpus.repo
		start = time.Now()
		out, err := cmd.CombinedOutput()
		gitTime += time.Since(start)
		if err != nil {
			b.Fatalf("git worktree add: %v\n%s", err, out)
		}

		b.StopTimer()
		rm := exec.Command("git", "worktree", "remove", "--force", wt)
		rm.Dir = corpus.repo
		if out, err := rm.CombinedOutput(); err != nil {
			b.Fatalf("git worktree remove: %v\n%s", err, out)
		}
		b.StartTimer()
	}
	b.StopTimer()
	forkNs := float64(forkTime.Nanoseconds()) / float64(b.N)
	gitNs := float64(gitTime.Nanoseconds()) / float64(b.N)
	b.ReportMetric(forkNs, "fork-ns/op")
	b.ReportMetric(gitNs, "worktree-ns/op")
	b.ReportMetric(gitNs/forkNs, "x-vs-baseline")
}

// BenchmarkForkTreeSize forks a one-file tree (the baseline) and the Go source tree
// alternately: x-vs-baseline near 1 shows that a fork's cost does not depend on the
// size of the tree.
func BenchmarkForkTreeSize(b *testing.B) {
	corpus := loadGoSrc(b)
	small, err := casstore.Open(b.TempDir()) // keeps the cached corpus untouched
	if err != nil {
		b.Fatal(err)
	}
	tiny, err := small.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "README", Hash: casstore.EmptyHash}})
	if err != nil {
		b.Fatal(err)
	}
	db := openBenchDB(b)
	var tinyTime, bigTime time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < forksPerOp; j++ { // interleaved, so both see the same disk load
			start := time.Now()
			fork(b, small, db, tiny)
			tinyTime += time.Since(start)
			start = time.Now()
			fork(b, corpus.store, db, corpus.root)
			bigTime += time.Since(start)
		}
	}
	b.StopTimer()
	tinyNs := float64(tinyTime.Nanoseconds()) / float64(b.N*forksPerOp)
	bigNs := float64(bigTime.Nanoseconds()) / float64(b.N*forksPerOp)
	b.ReportMetric(tinyNs, "tiny-fork-ns/op")
	b.ReportMetric(bigNs, "gosrc-fork-ns/op")
	b.ReportMetric(bigNs/tinyNs, "x-vs-baseline")
}

package faults

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// killAt runs tidepool with args, SIGKILLs it after delay (if it still runs) and
// reports whether it was killed, with its stdout and stderr.
func (e *env) killAt(delay time.Duration, args ...string) (killed bool, stdout, stderr string) {
	e.t.Helper()
	c := e.cmd(context.Background(), args...)
	var out, errb strings.Builder
	c.Stdout, c.Stderr = &out, &errb
	if err := c.Start(); err != nil {
		e.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Wait() }()
	select {
	case <-done:
		return false, out.String(), errb.String()
	case <-time.After(delay):
		c.Process.Signal(syscall.SIGKILL)
		err := <-done
		ws, ok := c.ProcessState.Sys().(syscall.WaitStatus)
		return err != nil && ok && ws.Signaled(), out.String(), errb.String()
	}
}

// timed runs a command once and returns how long it took, to spread kill points over.
func (e *env) timed(args ...string) (string, time.Duration) {
	e.t.Helper()
	start := time.Now()
	out := e.must(args...)
	return out, time.Since(start)
}

// points is how many kill points each operation gets.
const points = 20

// TestKillCLI SIGKILLs the CLI at random points of ingest, commit, gc and fork.
// Guarantees: fsck is clean after every kill; a re-run gives the root an undisturbed
// run gives; a killed fork leaves at most one record, and its re-run (same request
// id) exactly one; the next writer leaves no temp file behind.
func TestKillCLI(t *testing.T) {
	e := newEnv(t)
	r := seed(t)
	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, r, src, 250, 64<<10)
	upper := filepath.Join(t.TempDir(), "upper")
	writeTree(t, r, upper, 60, 64<<10)

	// References from a root of their own.
	ref := &env{t: t, bin: e.bin, root: filepath.Join(t.TempDir(), "ref")}
	refRoot, ingestTime := ref.timed("ingest", src)
	refRoot = lastLine(refRoot)
	refFork := ref.must("fork", refRoot)
	refCommit, commitTime := ref.timed("commit", "--base", refFork, "--upper", upper)
	refCommit = lastLine(refCommit)

	tried := map[string]int{}
	killed := map[string]int{}
	leftovers := 0
	check := func(op string, i int) {
		t.Helper()
		tried[op]++
		if out, err := e.run("fsck"); err != nil {
			t.Fatalf("%s kill point %d: fsck: %v\n%s", op, i, err, out)
		} else {
			leftovers += strings.Count(out, "leftover temp file")
		}
	}
	spread := func(d time.Duration) time.Duration { return time.Duration(r.Int63n(int64(d)*13/10 + 1)) }

	for i := 0; i < points; i++ {
		k, _, _ := e.killAt(spread(ingestTime), "ingest", src)
		if k {
			killed["ingest"]++
		}
		check("ingest", i)
		if got := lastLine(e.must("ingest", src)); got != refRoot {
			t.Fatalf("ingest kill point %d: re-run gives %s, want %s", i, got, refRoot)
		}
		// Make the next point start from an empty store again, so the kill lands
		// among new objects rather than a store that has them all.
		e.must("gc", "--grace", "0")
	}

	e.must("ingest", src)
	fork := e.must("fork", refRoot)
	for i := 0; i < points; i++ {
		k, _, _ := e.killAt(spread(commitTime), "commit", "--base", fork, "--upper", upper)
		if k {
			killed["commit"]++
		}
		check("commit", i)
		e.must("commit", "--base", fork, "--upper", upper)
		if got := e.forkRoot(fork); got != refCommit {
			t.Fatalf("commit kill point %d: fork at %s after the re-run, want %s", i, got, refCommit)
		}
		// Back to the base for the next point, through a fresh fork.
		fork = e.must("fork", refRoot)
	}

	for i := 0; i < points; i++ {
		garbage := filepath.Join(t.TempDir(), "garbage")
		writeTree(t, r, garbage, 100, 16<<10)
		e.must("ingest", garbage)
		_, gcTime := e.timed("gc", "--grace", "0", "--dry-run")
		k, _, _ := e.killAt(spread(gcTime*3), "gc", "--grace", "0")
		if k {
			killed["gc"]++
		}
		check("gc", i)
		e.must("gc", "--grace", "0")
		check("gc", i)
		tried["gc"]--
	}

	_, forkTime := e.timed("fork", refRoot)
	for i := 0; i < points; i++ {
		rid := fmt.Sprintf("kill-%d-%d", i, r.Int())
		k, _, _ := e.killAt(spread(forkTime), "fork", "--request-id", rid, refRoot)
		if k {
			killed["fork"]++
		}
		check("fork", i)
		if n := e.countRequest(rid); n > 1 {
			t.Fatalf("fork kill point %d: %d records for one request", i, n)
		}
		e.must("fork", "--request-id", rid, refRoot)
		if n := e.countRequest(rid); n != 1 {
			t.Fatalf("fork kill point %d: %d records after the re-run, want 1", i, n)
		}
	}

	// The next start sweeps what killed writers left.
	e.startDaemon()
	if left := e.tempFiles(); len(left) != 0 {
		t.Errorf("temp files after the daemon's start: %v", left)
	}
	e.fsck("at the end")
	t.Logf("kill points tried %v, killed mid-run %v (the rest finished first); leftover temp files seen by fsck: %d; failures: 0",
		tried, killed, leftovers)
}

// forkRoot returns a fork's current root.
func (e *env) forkRoot(id string) string {
	e.t.Helper()
	for _, f := range e.forks() {
		if f.ID == id {
			return f.Root
		}
	}
	e.t.Fatalf("fork %s not found", id)
	return ""
}

// countRequest counts the forks a request id made.
func (e *env) countRequest(rid string) int {
	n := 0
	for _, f := range e.forks() {
		if f.Labels["tidepool.dev/request-id"] == rid {
			n++
		}
	}
	return n
}

var _ = os.Getpid
var _ = rand.Int

package faults

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestKillDaemonDuringRPC SIGKILLs tidepoold at random points while the CLI creates
// forks and commits to a fork through it. Guarantees: the CLI either succeeds (it
// retries, reconnecting to the database once the daemon is gone) or says the record
// may exist; a re-run with the same request id never makes a second fork; every
// commit is recorded exactly once (no lost root, no duplicate history entry).
func TestKillDaemonDuringRPC(t *testing.T) {
	e := newEnv(t)
	r := seed(t)
	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, r, src, 50, 4096)
	root := lastLine(e.must("ingest", src))
	e.startDaemon()
	restart := func() {
		t.Helper()
		if err := e.daemon.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	spread := func(d time.Duration) time.Duration { return time.Duration(r.Int63n(int64(d)*12/10 + 1)) }
	// Kill points spread over how long each command takes with the daemon up.
	probe, forkTime := e.timed("fork", root)
	e.must("forks", "rm", probe)

	watch := e.watchDB()
	defer watch.close()
	var forkFailed, forkRetried int
	for i := 0; i < points; i++ {
		rid := fmt.Sprintf("rpc-%d-%d", i, r.Int())
		watch.drain()
		c := e.cmd(context.Background(), "fork", "--request-id", rid, root)
		var out, errb strings.Builder
		c.Stdout, c.Stderr = &out, &errb
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		e.killPoint(r, i, watch, forkTime, spread)
		if err := e.daemon.Kill(); err != nil {
			t.Fatal(err)
		}
		err := c.Wait()
		restart()
		switch {
		case err == nil:
			if strings.Contains(errb.String(), "retrying") {
				forkRetried++
			}
		case strings.Contains(errb.String(), "may have been created"):
			forkFailed++
			e.must("fork", "--request-id", rid, root)
		default:
			t.Fatalf("fork point %d: %v: %s", i, err, errb.String())
		}
		if n := e.countRequest(rid); n != 1 {
			t.Fatalf("fork point %d: %d records for request %s, want 1", i, n, rid)
		}
	}

	fork := e.must("fork", root)
	refUpper := filepath.Join(t.TempDir(), "ref-upper")
	writeTree(t, r, refUpper, 1, 100)
	_, commitTime := e.timed("commit", "--base", fork, "--upper", refUpper)
	var commitFailed, commitRetried int
	for i := 0; i < points; i++ {
		upper := filepath.Join(t.TempDir(), "upper")
		if err := os.MkdirAll(upper, 0o755); err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("commit-%02d.txt", i)
		if err := os.WriteFile(filepath.Join(upper, name), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
		before := e.forkRecord(fork)
		watch.drain()
		c := e.cmd(context.Background(), "commit", "--base", fork, "--upper", upper)
		var errb strings.Builder
		c.Stderr = &errb
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		e.killPoint(r, i, watch, commitTime, spread)
		if err := e.daemon.Kill(); err != nil {
			t.Fatal(err)
		}
		err := c.Wait()
		restart()
		if strings.Contains(errb.String(), "retrying") {
			commitRetried++
		}
		after := e.forkRecord(fork)
		if err != nil {
			commitFailed++
			if after.Root != before.Root {
				t.Fatalf("commit point %d failed (%v: %s) but the fork moved", i, err, errb.String())
			}
			e.must("commit", "--base", fork, "--upper", upper)
			after = e.forkRecord(fork)
		}
		if after.Root == before.Root || len(after.History) != min(len(before.History)+1, 16) {
			t.Fatalf("commit point %d: fork %s -> %s, history %d -> %d: want one new revision", i, before.Root, after.Root, len(before.History), len(after.History))
		}
		if !strings.Contains(e.must("ls-tree", fork), name) {
			t.Fatalf("commit point %d: %s missing from the fork", i, name)
		}
	}
	if n := len(e.forks()); n != points+1 {
		t.Errorf("%d forks at the end, want %d", n, points+1)
	}
	e.fsck("at the end")
	t.Logf("daemon killed at %d fork and %d commit points: forks retried and succeeded %d, failed with \"may have been created\" then re-run %d; commits retried and succeeded %d, failed then re-run %d; duplicates 0, lost 0",
		points, points, forkRetried, forkFailed, commitRetried, commitFailed)
}

// forkRecord returns one fork's record.
func (e *env) forkRecord(id string) forkRec {
	e.t.Helper()
	for _, f := range e.forks() {
		if f.ID == id {
			return f
		}
	}
	e.t.Fatalf("fork %s not found", id)
	return forkRec{}
}

// dbWatch reports writes to the fork database (inotify), so a kill can land while
// the daemon writes a record, before it answers.
type dbWatch struct{ fd int }

func (e *env) watchDB() *dbWatch {
	e.t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := unix.InotifyAddWatch(fd, filepath.Join(e.root, "forks.db"), unix.IN_MODIFY); err != nil {
		e.t.Fatal(err)
	}
	return &dbWatch{fd: fd}
}

func (w *dbWatch) close() { unix.Close(w.fd) }

// drain forgets pending events.
func (w *dbWatch) drain() {
	buf := make([]byte, 4096)
	for {
		if n, _ := unix.Read(w.fd, buf); n <= 0 {
			return
		}
	}
}

// waitWrites waits for n write events (at most timeout).
func (w *dbWatch) waitWrites(n int, timeout time.Duration) bool {
	buf := make([]byte, 4096)
	deadline := time.Now().Add(timeout)
	for seen := 0; seen < n; {
		if time.Now().After(deadline) {
			return false
		}
		k, _ := unix.Read(w.fd, buf)
		if k <= 0 {
			time.Sleep(50 * time.Microsecond)
			continue
		}
		for off := 0; off+unix.SizeofInotifyEvent <= k; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			off += unix.SizeofInotifyEvent + int(ev.Len)
			seen++
		}
	}
	return true
}

// killPoint waits for the point at which point i kills the daemon: even points at
// the first or second write of the record (mid-RPC: written, not yet answered),
// odd points at a random time within the command's usual duration.
func (e *env) killPoint(r *rand.Rand, i int, w *dbWatch, d time.Duration, spread func(time.Duration) time.Duration) {
	if i%2 == 0 {
		w.waitWrites(1+r.Intn(2), 10*time.Second)
		return
	}
	time.Sleep(spread(d))
}

package main

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
)

// dag writes a tree of levels+1 objects in which every tree names the one below
// twice ("a" and "b"), so it spells 2^levels paths; the bottom tree holds one file
// with the given content.
func dag(t *testing.T, s *casstore.Store, levels int, content string) casstore.Hash {
	t.Helper()
	blob, err := s.PutBytes([]byte(content))
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "f", Hash: blob}})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < levels; i++ {
		if h, err = s.WriteTree([]casstore.Entry{{Mode: casstore.ModeDir, Name: "a", Hash: h}, {Mode: casstore.ModeDir, Name: "b", Hash: h}}); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// runBounded runs the CLI and fails the test if it does not finish within limit:
// these commands used to run for hours on the trees below.
func (e *env) runBounded(limit time.Duration, args ...string) (stderr string, code int) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, append([]string{"--root", e.root}, args...)...)
	var se strings.Builder
	cmd.Stdout, cmd.Stderr = io.Discard, &se
	err := cmd.Run()
	if ctx.Err() != nil {
		e.t.Fatalf("tidepool %s did not finish within %s", strings.Join(args, " "), limit)
	}
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatal(err)
	}
	return se.String(), code
}

// TestWalksRefuseHugeDAG: a 41-object tree spelling 2^40 paths is refused by every
// walk that expands paths, with an error naming the limit, before anything is
// printed or written; walks that visit objects (fsck) stay linear.
func TestWalksRefuseHugeDAG(t *testing.T) {
	e := newEnv(t)
	a := dag(t, e.store, 40, "one\n")
	b := dag(t, e.store, 40, "two\n")
	for _, args := range [][]string{
		{"ls-tree", "-r", a.String()},
		{"checkout", a.String(), filepath.Join(t.TempDir(), "out")},
		{"diff", a.String(), b.String()},
	} {
		errOut, code := e.runBounded(time.Minute, args...)
		if code == 0 || !strings.Contains(errOut, "max_tree_entries") {
			t.Errorf("tidepool %s: exit %d, stderr %q; want a refusal naming max_tree_entries", args[0], code, errOut)
		}
	}
	if _, err := os.Stat(filepath.Join(t.TempDir(), "out")); err == nil {
		t.Error("checkout created its target")
	}
	// A limit can be raised or lowered per command.
	if errOut, code := e.runBounded(time.Minute, "--max-tree-entries", "100", "ls-tree", "-r", dag(t, e.store, 8, "x").String()); code == 0 || !strings.Contains(errOut, "more than 100 entries") {
		t.Errorf("ls-tree -r with --max-tree-entries 100: exit %d, %q", code, errOut)
	}
	e.ok("--max-tree-entries", "1000", "ls-tree", "-r", dag(t, e.store, 8, "x").String())
	// fsck marks objects, not paths: the DAG as a fork's root is checked at once.
	e.ok("fork", a.String())
	if errOut, code := e.runBounded(time.Minute, "fsck"); code != 0 {
		t.Errorf("fsck of a store holding the DAG: exit %d: %s", code, errOut)
	}
}

// TestWalkRefusesDeepTree: nesting past max_tree_depth is refused.
func TestWalkRefusesDeepTree(t *testing.T) {
	e := newEnv(t)
	h := casstore.EmptyHash
	b, err := e.store.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 1100; i++ {
		if h, err = b.WriteTree([]casstore.Entry{{Mode: casstore.ModeDir, Name: "d", Hash: h}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"ls-tree", "-r", h.String()},
		{"checkout", h.String(), filepath.Join(t.TempDir(), "out")},
	} {
		errOut, code := e.runBounded(time.Minute, args...)
		if code == 0 || !strings.Contains(errOut, "max_tree_depth") {
			t.Errorf("tidepool %s: exit %d, stderr %q; want a refusal naming max_tree_depth", args[0], code, errOut)
		}
	}
	e.ok("--max-tree-depth", "2000", "ls-tree", "-r", h.String())
}

// TestLsTreeHonoursSignals: a long listing stops at SIGTERM.
func TestLsTreeHonoursSignals(t *testing.T) {
	e := newEnv(t)
	a := dag(t, e.store, 40, "one\n")
	cmd := exec.Command(binary, "--root", e.root, "--max-tree-entries", "4000000000000", "ls-tree", "-r", a.String())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var se strings.Builder
	cmd.Stderr = &se
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Signal only once the walk prints (its signal handling is set up by then,
	// however slowly a loaded machine started the process), and keep draining.
	if _, err := out.Read(make([]byte, 1)); err != nil {
		t.Fatalf("ls-tree -r printed nothing: %v", err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { io.Copy(io.Discard, out); done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(se.String(), "context canceled") {
			t.Errorf("ls-tree -r after SIGTERM: %v, stderr %q; want it stopped by the signal", err, se.String())
		}
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		<-done
		t.Fatal("ls-tree -r ignored SIGTERM for 30s")
	}
}

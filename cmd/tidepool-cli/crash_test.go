package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestKilledIngestLeavesNoTempFiles: an ingest killed while it stages objects leaves
// temp files; fsck lists them, the next writer removes them, and the killed ingest's
// re-run gives the root an undisturbed ingest gives.
func TestKilledIngestLeavesNoTempFiles(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	for i := 0; i < 3000; i++ {
		p := filepath.Join(src, fmt.Sprintf("d%02d", i%50), fmt.Sprintf("f%04d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(strings.Repeat(fmt.Sprint(i), 200)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tmp := filepath.Join(e.root, "cas", ".tidepool-tmp")
	killed := false
	for attempt := 0; attempt < 5 && !killed; attempt++ {
		cmd := exec.Command(binary, "--root", e.root, "ingest", src)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			if ents, _ := os.ReadDir(tmp); len(ents) > 0 {
				cmd.Process.Kill()
				killed = true
				break
			}
			time.Sleep(time.Millisecond)
		}
		cmd.Wait()
	}
	if !killed {
		t.Fatal("never caught the ingest with staged files")
	}
	left, _ := os.ReadDir(tmp)
	if len(left) == 0 {
		t.Skip("the killed ingest left nothing staged (it finished first)")
	}
	// A temp file whose writer runs (this test) must survive the sweep.
	live := filepath.Join(tmp, "obj-"+fmt.Sprint(os.Getpid())+"."+selfStartTicks(t)+"-live")
	if err := os.WriteFile(live, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	out := e.ok("fsck")
	if n := strings.Count(out, "leftover temp file"); n != len(left) {
		t.Errorf("fsck listed %d leftover temp files, want %d:\n%s", n, len(left), out)
	}
	// The next writer sweeps what dead writers left.
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "x"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.ok("ingest", other)
	ents, _ := os.ReadDir(tmp)
	if len(ents) != 1 || ents[0].Name() != filepath.Base(live) {
		var names []string
		for _, d := range ents {
			names = append(names, d.Name())
		}
		t.Errorf("after the next writer, temp dir holds %v; want only the live writer's file", names)
	}
	os.Remove(live)
	got := ingestLastRoot(t, e.ok("ingest", src))
	want := ingestLastRoot(t, e.ok("--root", t.TempDir(), "ingest", src))
	if got != want {
		t.Errorf("re-run after the kill gives %s, a clean ingest %s", got, want)
	}
	if out := e.ok("fsck"); strings.Contains(out, "leftover") {
		t.Errorf("fsck after the re-run:\n%s", out)
	}
}

// selfStartTicks is this process's start time as /proc/self/stat gives it.
func selfStartTicks(t *testing.T) string {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return f[19]
}

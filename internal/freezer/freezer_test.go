package freezer

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

// TestFreezeAndThaw freezes a real process's cgroup: it stops making progress, a
// second freeze is refused, thaw resumes it.
func TestFreezeAndThaw(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a freezer cgroup")
	}
	h, err := hierarchy()
	if errors.Is(err, ErrNoFreezer) {
		t.Skip("no cgroup v1 freezer on this host")
	} else if err != nil {
		t.Fatal(err)
	}
	if _, err := Of(os.Getpid()); err == nil {
		// The test runs in a cgroup of its own (a container); not what this checks.
		t.Log("test process is in a freezer cgroup of its own")
	} else if !errors.Is(err, ErrNoFreezer) {
		t.Fatalf("root cgroup: %v", err)
	}
	dir := filepath.Join(h, fmt.Sprintf("tidepool-freezer-test-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", "i=0; while :; do i=$((i+1)); echo $i; done")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(dir, "freezer.state"), []byte(Thawed), 0)
		cmd.Process.Kill()
		cmd.Wait()
		for i := 0; i < 100 && os.Remove(dir) != nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(fmt.Sprint(cmd.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1<<16)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
	}()
	cg, err := Of(cmd.Process.Pid)
	if err != nil || cg.Path() != dir {
		t.Fatalf("Of = %q, %v; want %s", cg.Path(), err, dir)
	}
	<-lines
	thaw, err := cg.Freeze(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := cg.State(); st != Frozen {
		t.Fatalf("state %s", st)
	}
	if _, err := cg.Freeze(time.Second); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("second freeze: %v", err)
	}
	// Drain what was written before the freeze, then nothing comes.
	time.Sleep(50 * time.Millisecond)
	for len(lines) > 0 {
		<-lines
	}
	time.Sleep(150 * time.Millisecond)
	if n := len(lines); n != 0 {
		t.Fatalf("a frozen process wrote %d lines", n)
	}
	if err := thaw(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-lines:
	case <-time.After(5 * time.Second):
		t.Fatal("no progress after thaw")
	}
	// A cgroup that went away thaws as a no-op.
	if err := (Cgroup{dir: filepath.Join(h, "tidepool-no-such-cgroup")}).Thaw(); err != nil {
		t.Fatalf("thaw of a missing cgroup: %v", err)
	}
}

package shim

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/sys/reaper"
)

// reapChildEnv marks the test binary re-run by TestReapNotHeldUpByStalledSubscriber:
// the reaper collects every child of its process, so it runs alone in one.
const reapChildEnv = "TIDEPOOL_TEST_REAP_CHILD"

// TestReapNotHeldUpByStalledSubscriber: with a subscriber that takes no exit (the runc
// task service's exit processor, blocked on a container's lock that a Kill holds while
// `runc kill` runs) and more exits queued than its channel holds, a command's waiter
// (that `runc kill`) still gets its exit at once. With one serial reap loop, each exit
// beyond the stalled channel's 32 cost the loop a second, and the command's exit came
// only after all of them: here more than 30 s.
func TestReapNotHeldUpByStalledSubscriber(t *testing.T) {
	if os.Getenv(reapChildEnv) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestReapNotHeldUpByStalledSubscriber$", "-test.v")
		cmd.Env = append(os.Environ(), reapChildEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		t.Logf("%s", out)
		return
	}
	serveChildExits()
	stalled := reaper.Default.Subscribe()
	defer reaper.Default.Unsubscribe(stalled)

	// 64 commands at once: the stalled channel fills after 32 exits, and every
	// command's waiter (a runc kill, say) must still get its exit at once.
	start := time.Now()
	const n = 64
	waited := make(chan struct{}, n)
	for i := 0; i < n; i++ {
		c := exec.Command("true")
		ec, err := reaper.Default.Start(c)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			reaper.Default.Wait(c, ec)
			waited <- struct{}{}
		}()
	}
	deadline := time.After(15 * time.Second)
	for i := 0; i < n; i++ {
		select {
		case <-waited:
		case <-deadline:
			t.Fatalf("%d of %d commands' exits reached their waiters in 15 s: reaping is held up by the stalled subscriber", i, n)
		}
	}
	t.Logf("%d commands' exits reached their waiters in %v", n, time.Since(start))
}

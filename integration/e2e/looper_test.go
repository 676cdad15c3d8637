package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
)

// looper is a container on a fork of a tree holding files (src/a.txt among them),
// with its workdir at /app, that reads and writes until told to stop: every 0.2 s
// it checks src/a.txt and writes round N to /app/rN, so that tests can restart or
// reconfigure tidepoold under a workload that uses its view throughout.
type looper struct {
	s     *stack.Stack
	id    string
	root  string
	files map[string]string
	done  chan error
	out   string
}

// startLooper starts the container with `ctr run --rm` and returns once it runs.
func startLooper(t *testing.T, s *stack.Stack, id, root string, files map[string]string) *looper {
	t.Helper()
	want := strings.TrimSuffix(files["src/a.txt"], "\n")
	script := fmt.Sprintf(`set -e
touch /app/started
r=0
until [ -e /app/stop ]; do
  r=$((r+1))
  [ "$(cat /app/src/a.txt)" = %s ] || { echo "round $r: read failed"; exit 1; }
  echo "round $r" > /app/r$r
  [ $r -lt 1500 ] || { echo "never told to stop"; exit 1; }
  sleep 0.2
done
echo "ok $r"`, want)
	l := &looper{s: s, id: id, root: root, files: files, done: make(chan error, 1)}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		var err error
		l.out, err = s.C.CtrContext(ctx, "", append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/app")...), imagebuild.BusyboxRef, id, "sh", "-c", script)...)
		l.done <- err
	}()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
		if out, _ := s.Ctr("task", "ls"); strings.Contains(out, "RUNNING") {
			return l
		}
		if time.Now().After(deadline) {
			t.Fatal("container did not start")
		}
	}
}

// stopAndCheckCommit tells the container to stop, waits for it to go, and checks that
// its fork's commit equals re-ingesting its merged workdir: the tree, started, stop
// and the rounds it reports.
func (l *looper) stopAndCheckCommit(t *testing.T) {
	t.Helper()
	s := l.s
	if out, err := s.Ctr("task", "exec", "--exec-id", "stop", "--fifo-dir", s.C.FIFODir, l.id, "touch", "/app/stop"); err != nil {
		t.Fatalf("tell the container to stop: %v\n%s", err, out)
	}
	if err := <-l.done; err != nil {
		t.Fatalf("container: %v, output %q", err, l.out)
	}
	var rounds int
	i := strings.LastIndex(l.out, "ok ")
	if i < 0 {
		t.Fatalf("container output %q: no rounds", l.out)
	}
	if _, err := fmt.Sscanf(l.out[i:], "ok %d", &rounds); err != nil || rounds < 1 {
		t.Fatalf("container output %q: %v", l.out, err)
	}
	f := forkOfContainer(t, s, l.id, l.root)
	expect := map[string]string{"started": "", "stop": ""}
	for p, c := range l.files {
		expect[p] = c
	}
	for r := 1; r <= rounds; r++ {
		expect[fmt.Sprintf("r%d", r)] = fmt.Sprintf("round %d\n", r)
	}
	if re := s.Ingest(t, writeTree(t, expect)); re != f.Root.String() {
		t.Errorf("commit %s, re-ingest of the merged workdir %s", f.Root, re)
	}
}

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
)

// poolStack starts a stack whose tidepoold keeps a pool of the Node image.
func poolStack(t testing.TB, target int, extra string) *stack.Stack {
	t.Helper()
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{TidepooldConfig: func(s *stack.Stack) string {
		shimCfg := filepath.Join(s.Dir, "shim.toml")
		os.WriteFile(shimCfg, []byte(fmt.Sprintf("api_address = %q\n", s.APIAddress)), 0o644)
		return fmt.Sprintf(`
[pools]
containerd_address = %q
namespace = %q
holder = %q
shim_config = %q
[[pools.template]]
name = "node"
image = %q
workdir = "/app"
owner = "0:0"
min = 1
target = %d
max = %d
refill_rate = 20.0
max_age = "1h"
%s`, s.C.Address, s.C.Namespace, filepath.Join(s.Bin, "tidepool-holder"), shimCfg, imagebuild.NodeRef, target, 2*target, extra)
	}})
	s.C.ImportImage(t, node.Path, imagebuild.NodeRef, "tidepool")
	return s
}

type poolState struct{ idle, claimed, starting int }

func poolStatus(t testing.TB, s *stack.Stack, name string) poolState {
	t.Helper()
	for _, line := range strings.Split(s.MustTidepool(t, "pools"), "\n") {
		f := strings.Fields(line)
		if len(f) >= 4 && f[0] == name {
			var st poolState
			fmt.Sscan(f[1], &st.idle)
			fmt.Sscan(f[2], &st.claimed)
			fmt.Sscan(f[3], &st.starting)
			return st
		}
	}
	t.Fatalf("pool %s not listed", name)
	return poolState{}
}

func waitPool(t testing.TB, s *stack.Stack, name string, idle int) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		st := poolStatus(t, s, name)
		if st.idle == idle && st.claimed == 0 && st.starting == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s is %+v, want %d idle\n%s", name, st, idle, s.Daemon.LogTail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tidepoolRun runs `tidepool run` and returns stdout, stderr and the exit code.
func tidepoolRun(t testing.TB, s *stack.Stack, stdin string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(filepath.Join(s.Bin, "tidepool"), append([]string{"--root", s.Root, "run"}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

func TestPoolRun(t *testing.T) {
	s := poolStack(t, 2, "")
	root := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "node", 2)

	script := "node /app/src/main.js && cat > /app/from-stdin.txt && echo to-stderr >&2 && pwd && echo $GREETING; exit 3"
	out, errOut, code := tidepoolRun(t, s, "piped in\n", "--pool", "node", "--fork", root, "--env", "GREETING=hi", "--", "sh", "-c", script)
	if code != 3 || out != "hello Tidepool\n/app\nhi\n" || !strings.HasPrefix(errOut, "to-stderr\n") {
		t.Fatalf("exit %d\nstdout %q\nstderr %q", code, out, errOut)
	}
	// The fork's new root is reported, and holds exactly the command's writes.
	var forkID string
	for _, line := range strings.Split(errOut, "\n") {
		if rest, ok := strings.CutPrefix(line, "tidepool: fork "); ok {
			forkID = strings.Fields(rest)[0]
		}
	}
	if forkID == "" {
		t.Fatalf("no fork reported: %q", errOut)
	}
	if d := s.MustTidepool(t, "diff", root, forkID); d != "A from-stdin.txt\n" {
		t.Fatalf("fork changes %q", d)
	}
	if got := s.MustTidepool(t, "cat", forkID, "from-stdin.txt"); got != "piped in\n" {
		t.Fatalf("stdin reached the workload as %q", got)
	}
	// Exit statuses and missing commands behave as a shell's.
	if _, _, code := tidepoolRun(t, s, "", "--pool", "node", "--", "true"); code != 0 {
		t.Fatalf("true exited %d", code)
	}
	if _, e, code := tidepoolRun(t, s, "", "--pool", "node", "--", "no-such-command"); code != 127 || !strings.Contains(e, "not found") {
		t.Fatalf("missing command: exit %d, stderr %q", code, e)
	}
	if _, e, code := tidepoolRun(t, s, "", "--pool", "nope", "--", "true"); code != 1 || !strings.Contains(e, `no pool "nope"`) {
		t.Fatalf("unknown pool: exit %d, stderr %q", code, e)
	}
	waitPool(t, s, "node", 2)
}

var _ = context.Background

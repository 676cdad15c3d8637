// Package faults is Tidepool's fault-injection suite: the real CLI and daemon killed
// at random points, writers racing garbage collection with no grace, a filesystem
// that runs out of space. Every test states the guarantee it checks, prints its seed
// (TIDEPOOL_FAULT_SEED replays a run) and the number of points it tried.
package faults

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/localapi"
)

// env is one Tidepool root and the binaries under test.
type env struct {
	t      *testing.T
	bin    string
	root   string
	daemon *harness.Daemon
	api    string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testenv.RequireRoot(t)
	bin := testenv.ProjectBin()
	for _, b := range []string{"tidepool", "tidepoold"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Skipf("skipping: %s not built (make build): %v", b, err)
		}
	}
	return &env{t: t, bin: bin, root: filepath.Join(t.TempDir(), "root")}
}

// seed returns the run's random source, printing the seed.
func seed(t *testing.T) *rand.Rand {
	s := time.Now().UnixNano()
	if v := os.Getenv("TIDEPOOL_FAULT_SEED"); v != "" {
		var err error
		if s, err = strconv.ParseInt(v, 10, 64); err != nil {
			t.Fatalf("TIDEPOOL_FAULT_SEED: %v", err)
		}
	}
	t.Logf("seed %d (replay with TIDEPOOL_FAULT_SEED=%d)", s, s)
	return rand.New(rand.NewSource(s))
}

// cmd builds a tidepool command against the env's root.
func (e *env) cmd(ctx context.Context, args ...string) *exec.Cmd {
	c := exec.CommandContext(ctx, filepath.Join(e.bin, "tidepool"), append([]string{"--root", e.root}, args...)...)
	c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return c
}

// run runs tidepool and returns stdout, with stderr in the error.
func (e *env) run(args ...string) (string, error) {
	c := e.cmd(context.Background(), args...)
	var out, errb bytes.Buffer
	c.Stdout, c.Stderr = &out, &errb
	if err := c.Run(); err != nil {
		return out.String(), fmt.Errorf("tidepool %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

func (e *env) must(args ...string) string {
	e.t.Helper()
	out, err := e.run(args...)
	if err != nil {
		e.t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// lastLine is the last line of a command's stdout (ingest and commit print the root
// last).
func lastLine(s string) string {
	s = strings.TrimSpace(s)
	return s[strings.LastIndexByte(s, '\n')+1:]
}

// startDaemon runs tidepoold on the env's root (no containerd: forks, API, gc).
func (e *env) startDaemon() {
	e.t.Helper()
	dir := filepath.Dir(e.root)
	e.api = filepath.Join(dir, "api.sock")
	args := []string{"--root", e.root, "--address", filepath.Join(dir, "snap.sock"), "--api-address", e.api,
		"--metrics-address", "none", "--containerd-address", "none", "--log-level", "info"}
	e.daemon = harness.StartDaemon(e.t, harness.DaemonSpec{
		Name: "tidepoold", Path: filepath.Join(e.bin, "tidepoold"), Args: args,
		Env:    append(os.Environ(), "PATH="+testenv.SearchPath()),
		Notify: true,
		Ready: func(ctx context.Context) error {
			c, err := localapi.Dial(ctx, e.api, time.Second)
			if err != nil {
				return err
			}
			return c.Close()
		},
	})
}

// fsck runs `tidepool fsck` and fails the test unless the store is clean.
func (e *env) fsck(when string) string {
	e.t.Helper()
	out, err := e.run("fsck")
	if err != nil {
		e.t.Fatalf("fsck %s: %v\n%s", when, err, out)
	}
	return out
}

// tempFiles lists the staged files in the store's temp directory.
func (e *env) tempFiles() []string {
	ents, _ := os.ReadDir(filepath.Join(e.root, "cas", ".tidepool-tmp"))
	var out []string
	for _, d := range ents {
		out = append(out, d.Name())
	}
	return out
}

type forkRec struct {
	ID      string            `json:"id"`
	Root    string            `json:"root"`
	Labels  map[string]string `json:"labels"`
	History []json.RawMessage `json:"history"`
}

func (e *env) forks() []forkRec {
	e.t.Helper()
	var out []forkRec
	if err := json.Unmarshal([]byte(e.must("forks", "--json")), &out); err != nil {
		e.t.Fatalf("forks --json: %v", err)
	}
	return out
}

// writeTree fills dir with n files of random content (some repeated across calls, so
// objects are reused) and a few subdirectories.
func writeTree(t *testing.T, r *rand.Rand, dir string, n, maxSize int) {
	t.Helper()
	for i := 0; i < n; i++ {
		p := filepath.Join(dir, fmt.Sprintf("d%d", i%7), fmt.Sprintf("f%03d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var b []byte
		if r.Intn(3) == 0 {
			b = []byte(fmt.Sprintf("shared content %d\n", r.Intn(20)))
		} else {
			b = make([]byte, r.Intn(maxSize)+1)
			r.Read(b)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

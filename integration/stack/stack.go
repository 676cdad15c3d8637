// Package stack starts the whole Tidepool stack for real-stack tests: the project's
// binaries freshly built from this checkout, a tidepoold on its own root, and a
// private containerd that uses it as the proxy snapshotter "tidepool" and finds
// containerd-shim-tidepool-v1 on its PATH. Everything is torn down by t.Cleanup, on
// failure too.
package stack

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/platforms"

	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/localapi"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// Binaries builds tidepool, tidepoold and containerd-shim-tidepool-v1 from this
// checkout once per test process and points TIDEPOOL_BIN at them, so tests never run
// stale binaries. Cleanup removes them when the test binary's TestMain calls
// RemoveBinaries.
func Binaries(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		root, err := testenv.RepoRoot()
		if err != nil {
			buildErr = err
			return
		}
		buildDir, err = os.MkdirTemp("", "tidepool-bin-")
		if err != nil {
			buildErr = err
			return
		}
		cmd := exec.Command("go", "build", "-o", buildDir+"/", "./cmd/...")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build ./cmd/...: %v\n%s", err, out)
			return
		}
		os.Setenv("TIDEPOOL_BIN", buildDir)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

// RemoveBinaries deletes what Binaries built; call it from TestMain after m.Run.
func RemoveBinaries() {
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
}

// Options shape a stack.
type Options struct {
	// Containerd is passed to harness.StartContainerd; the tidepool proxy plugin is
	// added to it.
	Containerd harness.Options
	// TidepooldConfig, if set, returns TOML for tidepoold's --config; it is called
	// once containerd runs, so it can name containerd's address and namespace.
	TidepooldConfig func(s *Stack) string
	// Metrics serves tidepoold's Prometheus metrics on a free local port
	// (Stack.MetricsURL); otherwise they are off.
	Metrics bool
	// Prepare, if set, adjusts the containerd options once the stack's paths (API
	// socket, directory) are known and before containerd starts.
	Prepare func(s *Stack, o *harness.Options)
	// RootLink gives tidepoold its root through a symbolic link (Root links to
	// Root + ".real"), as on a host whose /var/lib links to a data disk: the kernel's
	// mount table shows the real path.
	RootLink bool
}

// Stack is one running Tidepool stack.
type Stack struct {
	Dir         string // short private directory holding the root and sockets
	Root        string // tidepoold's root
	SnapAddress string
	APIAddress  string
	Bin         string
	Daemon      *harness.Daemon
	C           *harness.Containerd
	// MetricsURL is tidepoold's /metrics when Options.Metrics is set.
	MetricsURL string
	config     string // tidepoold's config file as Start wrote it
}

// Start starts tidepoold, then containerd configured to use it.
func Start(t testing.TB, opts Options) *Stack {
	t.Helper()
	testenv.RequireRoot(t)
	bin := Binaries(t)
	dir, err := os.MkdirTemp("/tmp", "tps-")
	if err != nil {
		t.Fatal(err)
	}
	s := &Stack{
		Dir: dir, Root: filepath.Join(dir, "root"), Bin: bin,
		SnapAddress: filepath.Join(dir, "snap.sock"), APIAddress: filepath.Join(dir, "api.sock"),
	}
	if opts.RootLink {
		if err := os.Mkdir(s.Root+".real", 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Base(s.Root)+".real", s.Root); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if left, _ := harness.MountsUnder(dir); len(left) > 0 {
			tail := ""
			if s.Daemon != nil {
				tail = s.Daemon.LogTail(400)
			}
			t.Errorf("mounts left under the tidepool root: %v\ntidepoold log:\n%s", left, tail)
			for i := len(left) - 1; i >= 0; i-- {
				exec.Command("umount", "-l", left[i]).Run()
			}
		}
		os.RemoveAll(dir)
	})
	// Containerd is torn down before tidepoold (cleanups run last-registered first):
	// containers and their rootfs mounts go first, then the views under them.
	var daemon *harness.Daemon
	t.Cleanup(func() {
		if daemon == nil {
			return
		}
		if t.Failed() {
			t.Logf("last lines of tidepoold:\n%s", daemon.LogTail(60))
		}
		if err := daemon.Stop(); err != nil {
			t.Errorf("stop tidepoold: %v\n%s", err, daemon.LogTail(2000))
		}
		daemon.Close()
	})
	co := opts.Containerd
	if opts.Prepare != nil {
		opts.Prepare(s, &co)
	}
	if co.ProxyPlugins == nil {
		co.ProxyPlugins = map[string]harness.ProxyPlugin{}
	}
	co.ProxyPlugins["tidepool"] = harness.ProxyPlugin{
		Type: "snapshot", Address: s.SnapAddress,
		Exports: map[string]string{"root": s.Root}, Capabilities: []string{"rebase"},
	}
	// The transfer service (ctr images import/pull) unpacks only for snapshotters it
	// has an unpack entry for.
	// A deletion triggers garbage collection at once (as contrib's config does), so a
	// removed container's fork advances promptly however busy the machine is.
	co.ExtraTOML = fmt.Sprintf(`
[plugins."io.containerd.gc.v1.scheduler"]
  deletion_threshold = 1
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = %[1]q
  snapshotter = "overlayfs"
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = %[1]q
  snapshotter = "tidepool"
`, platforms.DefaultString()) + co.ExtraTOML
	s.C = harness.StartContainerd(t, co)
	// Runs before containerd's teardown (cleanups run last registered first).
	t.Cleanup(func() { s.drainSlots(t) })

	metrics := "none"
	if opts.Metrics {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		metrics = l.Addr().String()
		l.Close()
		s.MetricsURL = "http://" + metrics + "/metrics"
	}
	args := []string{"--root", s.Root, "--address", s.SnapAddress, "--api-address", s.APIAddress,
		"--metrics-address", metrics, "--log-level", "debug"}
	// containerd's address goes in the config file, not argv: the harness finds an
	// instance's leftover shims by that address on their command lines.
	cfg := fmt.Sprintf("containerd_address = %q\n", s.C.Address)
	// TIDEPOOL_VIEWS_MODE runs the real-stack tests with views.mode kernel, fuse or auto.
	if mode := os.Getenv("TIDEPOOL_VIEWS_MODE"); mode != "" {
		cfg += fmt.Sprintf("views.mode = %q\n", mode)
	}
	// TIDEPOOL_VIEWS_LAYERING runs them with views.layering direct or nested.
	if l := os.Getenv("TIDEPOOL_VIEWS_LAYERING"); l != "" {
		cfg += fmt.Sprintf("views.layering = %q\n", l)
	}
	if opts.TidepooldConfig != nil {
		cfg += opts.TidepooldConfig(s)
	}
	s.config = cfg
	cfgPath := filepath.Join(dir, "tidepoold.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	args = append(args, "--config", cfgPath)
	daemon = harness.NewDaemon(harness.DaemonSpec{
		Name: "tidepoold", Path: filepath.Join(bin, "tidepoold"), Args: args,
		Env:     append(os.Environ(), "PATH="+testenv.SearchPath()),
		LogPath: filepath.Join(dir, "tidepoold.log"),
		// As systemd runs it (contrib/systemd, Type=notify): ready once it says so,
		// which is once containerd reaches it, and it serves the API.
		Notify: true,
		Ready:  func(ctx context.Context) error { return s.ping(ctx) },
	})
	if err := daemon.Start(context.Background()); err != nil {
		t.Fatalf("start tidepoold: %v\n%s", err, daemon.LogTail(30))
	}
	s.Daemon = daemon
	return s
}

// drainSlots destroys the pool members whose slots (kernel mounts, which outlive
// tidepoold like kernel views) would otherwise be left mounted once containerd goes
// without removing their snapshots: tidepoold is replaced, as a crash or an upgrade
// would, by one whose configuration has no pool templates, which destroys the
// members it finds; then every slot must be gone.
func (s *Stack) drainSlots(t testing.TB) {
	slots := filepath.Join(s.Root, "slots")
	if ents, _ := os.ReadDir(slots); len(ents) == 0 || s.Daemon == nil {
		return
	}
	cfgPath := filepath.Join(s.Dir, "tidepoold.toml")
	b, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Error(err)
		return
	}
	cfg, _, _ := strings.Cut(string(b), "[[pools.template]]")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Error(err)
		return
	}
	if s.Daemon.Running() {
		if err := s.Daemon.Kill(); err != nil {
			t.Error(err)
			return
		}
	}
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Errorf("restart tidepoold to drain its pools: %v\n%s", err, s.Daemon.LogTail(40))
		return
	}
	deadline := time.Now().Add(2 * time.Minute)
	for next := time.Now().Add(5 * time.Second); ; {
		ents, _ := os.ReadDir(slots)
		if len(ents) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("slots left after the pools were drained: %v\n%s", ents, s.Daemon.LogTail(40))
			return
		}
		if time.Now().After(next) {
			// A container removed just before tidepoold was replaced may have had its
			// snapshot's removal fail while no tidepoold answered; containerd retries
			// that only at its next garbage collection. Run one.
			s.syncGC(t)
			next = time.Now().Add(10 * time.Second)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// syncGC has containerd collect garbage now (what `ctr leases delete --sync` does),
// removing the snapshots of removed containers; failures are only logged.
func (s *Stack) syncGC(t testing.TB) {
	id := fmt.Sprintf("tidepool-test-gc-%d", time.Now().UnixNano())
	if _, err := s.C.Ctr("leases", "create", "--id", id); err != nil {
		t.Logf("create a lease to collect garbage with: %v", err)
		return
	}
	if _, err := s.C.Ctr("leases", "delete", "--sync", id); err != nil {
		t.Logf("collect garbage (ctr leases delete --sync): %v", err)
	}
}

func (s *Stack) ping(ctx context.Context) error {
	c, err := localapi.Dial(ctx, s.APIAddress, time.Second)
	if err != nil {
		return err
	}
	return c.Close()
}

// RestartDaemon stops tidepoold (SIGTERM) and starts it again on the same root.
func (s *Stack) RestartDaemon(t testing.TB) {
	t.Helper()
	if err := s.Daemon.Restart(context.Background()); err != nil {
		t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
}

// RestartDaemonWith restarts tidepoold (SIGTERM) with top, top-level TOML keys such
// as `views.layering = "nested"`, ahead of the config Start wrote.
func (s *Stack) RestartDaemonWith(t testing.TB, top string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(s.Dir, "tidepoold.toml"), []byte(top+"\n"+s.config), 0o644); err != nil {
		t.Fatal(err)
	}
	s.RestartDaemon(t)
}

// Tidepool runs the CLI against the stack's root.
func (s *Stack) Tidepool(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(s.Bin, "tidepool"), append([]string{"--root", s.Root}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("tidepool %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

// MustTidepool runs the CLI and fails the test on error.
func (s *Stack) MustTidepool(t testing.TB, args ...string) string {
	t.Helper()
	out, err := s.Tidepool(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Ingest ingests dir and returns the root.
func (s *Stack) Ingest(t testing.TB, dir string) string {
	t.Helper()
	out := strings.TrimSpace(s.MustTidepool(t, "ingest", dir))
	lines := strings.Split(out, "\n")
	return lines[len(lines)-1]
}

// Ctr runs ctr against the stack's containerd in its namespace.
func (s *Stack) Ctr(args ...string) (string, error) { return s.C.Ctr(args...) }

// MustCtr runs ctr and fails the test on error.
func (s *Stack) MustCtr(t testing.TB, args ...string) string {
	t.Helper()
	out, err := s.C.Ctr(args...)
	if err != nil {
		t.Fatalf("%v\ntidepoold log:\n%s", err, s.Daemon.LogTail(30))
	}
	return out
}

// Forks lists the fork records through the CLI (and so through tidepoold's API).
func (s *Stack) Forks(t testing.TB) []forks.Fork {
	t.Helper()
	var list []forks.Fork
	if err := json.Unmarshal([]byte(s.MustTidepool(t, "forks", "--json")), &list); err != nil {
		t.Fatal(err)
	}
	return list
}

// WaitFork polls until a fork satisfies ok (containerd removes snapshots, and so
// commits them, in its garbage collection shortly after a container is deleted).
func (s *Stack) WaitFork(t testing.TB, what string, ok func(forks.Fork) bool) forks.Fork {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		for _, f := range s.Forks(t) {
			if ok(f) {
				return f
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no fork %s after 60s; forks: %+v\ntidepoold log:\n%s", what, s.Forks(t), s.Daemon.LogTail(40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Metric returns the sum of a Prometheus metric's samples whose label set contains
// every given "name=\"value\"" pair, from tidepoold's /metrics.
func (s *Stack) Metric(t testing.TB, name string, labels ...string) float64 {
	t.Helper()
	resp, err := http.Get(s.MetricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(line, l)
		}
		if f := strings.Fields(line); ok && len(f) == 2 {
			var v float64
			fmt.Sscan(f[1], &v)
			sum += v
		}
	}
	return sum
}

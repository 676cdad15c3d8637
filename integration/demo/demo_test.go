// Package demo is `make demo`: Tidepool's main job end to end on an embedded default,
// narrated on stdout. It starts its own containerd and tidepoold under a temp dir,
// builds a "baked" Node image (node plus a node_modules tree from the npm registry),
// ingests a real source tree (the Go toolchain's own source), forks it, commits a
// change, and runs containers that need both the image's dependencies and the fork's
// source, through the snapshot-label path and through the tidepool runtime shim. It is
// also a test: `make test` runs it quietly.
package demo

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/shim"
)

func TestMain(m *testing.M) {
	code := m.Run()
	stack.RemoveBinaries()
	os.Exit(code)
}

type timing struct {
	what string
	took time.Duration
}

type narrator struct {
	t       *testing.T
	timings []timing
}

func (n *narrator) say(format string, args ...any) {
	if testing.Verbose() {
		fmt.Printf(format+"\n", args...)
	}
}

// step runs fn, prints its title and how long it took, and records the timing.
func (n *narrator) step(title string, fn func() string) string {
	n.t.Helper()
	start := time.Now()
	out := fn()
	took := time.Since(start)
	n.timings = append(n.timings, timing{title, took})
	n.say("\n== %s  (%s)", title, took.Round(time.Millisecond))
	if out != "" {
		for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
			n.say("   %s", line)
		}
	}
	return out
}

// demoScript is run by node in the container: lodash comes from the image's
// /app/node_modules (baked dependencies), the files it reads come from the fork at
// /src (the Go source tree), and what it writes lands on the fork.
const demoScript = `
const _ = require('/app/node_modules/lodash');
const fs = require('fs'), path = require('path');
const dir = '/src/net/http';
const files = fs.readdirSync(dir).filter(f => f.endsWith('.go'));
const lines = _.sumBy(files, f => fs.readFileSync(path.join(dir, f), 'utf8').split('\n').length);
const biggest = _.maxBy(files, f => fs.statSync(path.join(dir, f)).size);
console.log('net/http: ' + files.length + ' Go files, ' + lines + ' lines; biggest ' + biggest + ' (lodash ' + _.VERSION + ' from the image)');
fs.writeFileSync('/src/DEMO.md', 'written by a container at ' + new Date().toISOString() + '\n');
`

func TestDemo(t *testing.T) {
	n := &narrator{t: t}
	n.say("Tidepool demo: baked dependencies from the image, forked source from the store, in containerd.")
	var archive imagebuild.Archive
	n.step("build the baked image (busybox + node + node_modules from npm), cached after the first run", func() string {
		archive = imagebuild.NodeArchive(t)
		return "image archive " + archive.Path
	})
	n.step("build tidepool, tidepoold and containerd-shim-tidepool-v1 from this checkout", func() string {
		return "binaries in " + stack.Binaries(t)
	})
	var s *stack.Stack
	n.step("start a private containerd 2.4.2 and tidepoold (with a warm pool of the image) under a temp dir", func() string {
		s = stack.Start(t, stack.Options{TidepooldConfig: warmPool})
		s.C.ImportImage(t, archive.Path, imagebuild.NodeRef, "tidepool", "overlayfs")
		return "containerd " + s.C.Address + "\ntidepoold  " + s.SnapAddress + " (root " + s.Root + ")"
	})
	src := filepath.Join(runtime.GOROOT(), "src")
	var root string
	n.step("ingest a real source tree: "+src, func() string {
		root = s.Ingest(t, src)
		return "root " + root
	})
	n.step("ingest it again (objects already stored: hashing only)", func() string {
		if again := s.Ingest(t, src); again != root {
			t.Fatalf("re-ingest gave %s, want %s", again, root)
		}
		return ""
	})
	var forkID string
	n.step("fork it (one record: O(1) whatever the tree's size)", func() string {
		forkID = strings.TrimSpace(s.MustTidepool(t, "fork", root, "--label", "demo"))
		return "fork " + forkID
	})
	n.step("change a file through `tidepool commit` (an overlay upper dir with one edit)", func() string {
		upper := t.TempDir()
		os.MkdirAll(filepath.Join(upper, "fmt"), 0o755)
		os.WriteFile(filepath.Join(upper, "fmt", "DEMO-NOTE.txt"), []byte("committed by the demo\n"), 0o644)
		newRoot := strings.TrimSpace(s.MustTidepool(t, "commit", "--base", forkID, "--upper", upper))
		return "new root " + newRoot + "\n" + s.MustTidepool(t, "diff", root, forkID)
	})
	n.step("run a container with the fork at /src (snapshot labels, runc)", func() string {
		return s.MustCtr(t, "run", "--rm", "--fifo-dir", s.C.FIFODir, "--snapshotter", "tidepool",
			"--snapshotter-label", binding.LabelFork+"="+forkID, "--snapshotter-label", binding.LabelWorkdir+"=/src",
			imagebuild.NodeRef, "demo-labels", "node", "-e", demoScript)
	})
	f := s.WaitFork(t, "demo advanced by the container", func(f forks.Fork) bool {
		return f.ID == forkID && strings.Contains(s.MustTidepool(t, "diff", root, f.ID), "DEMO.md")
	})
	n.step("the container's writes are the fork's next root", func() string {
		return "fork " + forkID + " is at " + f.Root.String() + "\n" + s.MustTidepool(t, "diff", root, forkID)
	})
	n.step("the same through the runtime shim and OCI annotations (as nerdctl would)", func() string {
		return shimRun(t, s, root, "demo-shim", "node", "-e", demoScript)
	})
	n.step("baseline: the same image on containerd's overlayfs snapshotter, no fork", func() string {
		return s.MustCtr(t, "run", "--rm", "--fifo-dir", s.C.FIFODir, "--snapshotter", "overlayfs",
			imagebuild.NodeRef, "demo-base", "node", "-e", "console.log('lodash ' + require('/app/node_modules/lodash').VERSION)")
	})
	n.step("the warm pool is full (filled in the background since tidepoold started: members created on tidepool-holder, then frozen)", func() string {
		return waitWarm(t, s, poolTarget)
	})
	var warmOut string
	n.step("warm start: claim a frozen member, bind the fork at /src, run the same node command (tidepool run --pool)", func() string {
		out, report := tidepoolRun(t, s, "--pool", "demo", "--fork", forkID, "--", "node", "-e", demoScript)
		warmOut = out
		return out + report
	})
	n.step("the warm command's change landed on the fork", func() string {
		return s.MustTidepool(t, "diff", f.Root.String(), forkID)
	})
	n.step("cold start: the same command with `ctr run` (our shim and snapshotter, the fork by annotation)", func() string {
		return shimRun(t, s, forkID, "demo-cold", "node", "-e", demoScript)
	})
	if !strings.HasPrefix(warmOut, "net/http: ") {
		t.Fatalf("warm command printed %q", warmOut)
	}
	warm, cold := n.timings[len(n.timings)-3].took, n.timings[len(n.timings)-1].took
	n.step("the pool refills to its target", func() string { return waitWarm(t, s, poolTarget) })
	const quick = "head -1 /src/go.mod && echo quick > /src/QUICK.txt"
	n.step("warm start of a short command: "+quick, func() string {
		out, report := tidepoolRun(t, s, "--pool", "demo", "--fork", forkID, "--", "sh", "-c", quick)
		return out + report
	})
	n.step("cold start of the same short command with `ctr run`", func() string {
		return shimRun(t, s, forkID, "demo-cold-quick", "sh", "-c", quick)
	})
	quickWarm, quickCold := n.timings[len(n.timings)-2].took, n.timings[len(n.timings)-1].took
	n.say("\nWarm vs cold, same command and fork, wall clock of the client command (tidepool run / ctr run --rm):")
	n.say("  node over net/http: warm %s, cold %s: %.1fx", warm.Round(time.Millisecond), cold.Round(time.Millisecond), float64(cold)/float64(warm))
	n.say("  short command:      warm %s, cold %s: %.1fx", quickWarm.Round(time.Millisecond), quickCold.Round(time.Millisecond), float64(quickCold)/float64(quickWarm))
	n.say("  (one run each on a shared machine: `make bench` has the measured claim latencies)")
	n.say("\nTimings")
	for _, tm := range n.timings {
		n.say("  %10s  %s", tm.took.Round(time.Millisecond), tm.what)
	}
	leakCheckBesidesPool(t, s)
}

// poolTarget is how many idle members the demo's pool keeps.
const poolTarget = 2

// warmPool is tidepoold's config for a pool "demo" of the baked image, whose members
// get their fork at /src (where the demo's script reads it).
func warmPool(s *stack.Stack) string {
	return s.PoolConfig(stack.Pool{Name: "demo", Image: imagebuild.NodeRef, Workdir: "/src", Target: poolTarget})
}

// waitWarm waits until the pool holds target idle members and returns `tidepool pools`.
func waitWarm(t *testing.T, s *stack.Stack, target int) string {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		out := s.MustTidepool(t, "pools")
		for _, line := range strings.Split(out, "\n") {
			var name string
			var idle int
			if f := strings.Fields(line); len(f) > 2 && f[0] == "demo" {
				name = f[0]
				fmt.Sscan(f[1], &idle)
			}
			if name == "demo" && idle >= target {
				return out
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool demo not filled after 2m:\n%s\n%s", out, s.Daemon.LogTail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tidepoolRun runs `tidepool run` and returns its stdout and its report line.
func tidepoolRun(t *testing.T, s *stack.Stack, args ...string) (string, string) {
	t.Helper()
	cmd := exec.Command(filepath.Join(s.Bin, "tidepool"), append([]string{"--root", s.Root, "run"}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("tidepool run: %v\n%s%s\n%s", err, out.String(), errb.String(), s.Daemon.LogTail(40))
	}
	return out.String(), errb.String()
}

// leakCheckBesidesPool checks that nothing of the demo's own containers is left: what
// remains belongs to the pool's idle members (which stay, by design, until tidepoold's
// next start), and the pool holds exactly its target again.
func leakCheckBesidesPool(t *testing.T, s *stack.Stack) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		out := s.MustCtr(t, "containers", "ls", "-q", `labels."dev.tidepool.pool"==demo`)
		members := strings.Fields(out)
		l, err := s.C.Leaks()
		if err != nil {
			t.Fatal(err)
		}
		var left []string
		keep := func(items ...string) {
			for _, it := range items {
				ours := false
				for _, m := range members {
					ours = ours || strings.Contains(it, m)
				}
				if !ours {
					left = append(left, it)
				}
			}
		}
		keep(l.Mounts...)
		keep(l.Cgroups...)
		keep(l.RuncState...)
		keep(l.Bundles...)
		// Members share shims (grouped): a shim is the pool's while it is the
		// parent of a member's task, whatever member it was started for.
		serving := harness.TaskParents(s.MustCtr(t, "tasks", "ls"), members...)
		for _, p := range l.Shims {
			if !serving[p.Pid] {
				keep(fmt.Sprint(p))
			}
		}
		if len(left) == 0 && len(members) == poolTarget {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind besides the pool's %d members %v:\n%s", len(members), members, strings.Join(left, "\n"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// shimRun is `ctr run --rm` of the baked image through the tidepool runtime shim, with
// fork (a root or fork id) at /src by OCI annotation, as nerdctl would run it.
func shimRun(t *testing.T, s *stack.Stack, fork, id string, args ...string) string {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "shim.toml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("api_address = %q\n", s.APIAddress)), 0o644); err != nil {
		t.Fatal(err)
	}
	return s.MustCtr(t, append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir, "--runtime", shim.RuntimeName, "--runtime-config-path", cfg,
		"--snapshotter", "tidepool", "--annotation", binding.AnnotationFork + "=" + fork, "--annotation", binding.AnnotationWorkdir + "=/src",
		imagebuild.NodeRef, id}, args...)...)
}

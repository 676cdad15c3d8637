package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/pool/holder"
)

// busyboxPoolStack starts a stack whose tidepoold keeps a pool "bb" of the busybox
// image with its workdir at /src, where the image has nothing: the workdir a claim
// sees is exactly its fork.
func busyboxPoolStack(t testing.TB, target int) *stack.Stack {
	t.Helper()
	s := stack.Start(t, stack.Options{Metrics: true, TidepooldConfig: func(s *stack.Stack) string {
		return s.PoolConfig(stack.Pool{Name: "bb", Image: imagebuild.BusyboxRef, Workdir: "/src", Target: target})
	}})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	return s
}

// untarIngest unpacks a tar stream into a temp dir and ingests it: the root of what
// a member's workdir showed.
func untarIngest(t testing.TB, s *stack.Stack, tarball string) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("tar", "-x", "-C", dir)
	cmd.Stdin = strings.NewReader(tarball)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("untar the workdir: %v\n%s", err, out)
	}
	return s.Ingest(t, dir)
}

// TestPoolClaimKernelView: with kernel views, a member's fork is mounted onto its
// slot at claim. The claimed member's workdir is exactly the fork (its tar, ingested,
// is the fork's root) and is served by a kernel view, not FUSE; its edits (writes,
// appends, a chmod, a renamed directory, a deletion, a symlink) commit exactly: the
// fork's new root equals ingesting its merged workdir as the workload saw it at the
// end. A claimed member whose tidepoold is killed keeps reading and writing its
// workdir, and the next tidepoold commits its changes when it exits. Afterwards no
// mount, slot, view or member of the claims is left.
func TestPoolClaimKernelView(t *testing.T) {
	requireKernelViews(t)
	s := busyboxPoolStack(t, 2)
	base := s.Ingest(t, writeTree(t, appSource))
	waitPool(t, s, "bb", 2)
	if ents, _ := os.ReadDir(filepath.Join(s.Root, "slots")); len(ents) != 2 {
		t.Fatalf("idle members have %d slots, want 2 (kernel views: members get a slot)", len(ents))
	}

	var members []string
	run := func(fork, script string) (stdout, root string) {
		t.Helper()
		out, errOut, code := tidepoolRun(t, s, "", "--pool", "bb", "--fork", fork, "--", "sh", "-c", script)
		if code != 0 {
			t.Fatalf("tidepool run %q: exit %d\n%s", script, code, errOut)
		}
		m := reportedFork.FindStringSubmatch(errOut)
		if m == nil {
			t.Fatalf("no fork reported: %q", errOut)
		}
		members = append(members, m[3])
		return out, m[2]
	}

	// Reads: the workdir is the fork, on an overlay mounted onto the slot, served
	// by the kernel (no FUSE operation), owned by the pool's owner.
	fork := runFork(t, s, base, "claim-kview")
	out, errOut, code := tidepoolRun(t, s, "", "--pool", "bb", "--fork", fork, "--", "sh", "-c",
		"grep ' /src ' /proc/self/mounts | tail -1 | cut -d' ' -f1,3 >&2; stat -c %u:%g /src >&2; tar -C /src -cf - .")
	m := reportedFork.FindStringSubmatch(errOut)
	if code != 0 || m == nil || !strings.HasPrefix(errOut, "tidepool-slot overlay\n0:0\n") {
		t.Fatalf("reading run: exit %d, stderr %q", code, errOut)
	}
	members = append(members, m[3])
	root := m[2]
	if got := untarIngest(t, s, out); got != base {
		t.Fatalf("the claimed workdir holds %s, the fork %s", got, base)
	}
	if root != base {
		t.Fatalf("a read-only run moved the fork to %s", root)
	}
	if n := s.Metric(t, "tidepool_views_operations_total"); n != 0 {
		t.Fatalf("%v FUSE operations served: the claim's view is not a kernel view", n)
	}

	// Edits: the commit equals the merged workdir the workload last saw.
	edits := "cd /src && echo new > new.txt && echo more >> README.md && chmod 755 src/greet.js && mv src lib && rm lib/old.js && " +
		"ln -s lib/main.js main && mkdir -p a/b && echo deep > a/b/c && tar -cf - ."
	out, root = run(fork, edits)
	if want := untarIngest(t, s, out); root != want {
		t.Fatalf("commit %s, want %s (the merged workdir); diff:\n%s", root, want, s.MustTidepool(t, "diff", want, root))
	}
	if got := forkRoot(t, s, fork); got != root {
		t.Fatalf("fork %s at %s, the run reported %s", fork, got, root)
	}
	if d := s.MustTidepool(t, "diff", base, root); d != "M README.md\nA a/b/c\nA lib/greet.js\nA lib/main.js\nA main\nA new.txt\nD src/greet.js\nD src/main.js\nD src/old.js\n" {
		t.Fatalf("fork changes:\n%s", d)
	}

	// A claimed member outlives a SIGKILLed tidepoold: its kernel view keeps
	// serving, and the next tidepoold commits what it wrote when it exits.
	client, err := localapi.Dial(context.Background(), s.APIAddress, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	var first syncBuffer
	flag := holder.ControlDir + "/go"
	go client.Run(context.Background(), &apiv1.RunStart{Pool: "bb", Fork: fork, Args: []string{"sh", "-c",
		"echo before > /src/before.txt && echo started && while [ ! -e " + flag + " ]; do sleep 0.05; done && cat /src/new.txt > /src/after.txt"}},
		localapi.RunStreams{Stdout: &first, Stderr: &first})
	waitFor(t, "the workload started", func() string {
		if !strings.Contains(first.String(), "started") {
			return "output " + first.String()
		}
		return ""
	})
	member := claimedMember(t, s, members)
	upper := slotUpper(t, s, member)
	if err := s.Daemon.Kill(); err != nil {
		t.Fatal(err)
	}
	// With no tidepoold, the workload goes on (told through its control
	// directory, a plain bind mount) and reads and writes its workdir.
	if err := os.WriteFile(filepath.Join(s.Root, "pools", member, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the workload read its workdir with no tidepoold", func() string {
		if _, err := os.Stat(filepath.Join(upper, "after.txt")); err != nil {
			return err.Error()
		}
		return ""
	})
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
	f := s.WaitFork(t, "with the orphaned member's commit", func(f forks.Fork) bool { return f.ID == fork && f.Root.String() != root })
	if d := s.MustTidepool(t, "diff", root, f.Root.String()); d != "A after.txt\nA before.txt\n" {
		t.Fatalf("the orphaned member's commit: %s", d)
	}
	if got := s.MustTidepool(t, "cat", fork, "after.txt"); got != "new\n" {
		t.Fatalf("after.txt = %q", got)
	}
	members = append(members, member)

	waitPool(t, s, "bb", 2)
	waitFor(t, "only the members left", func() string { return checkOnlyMembers(t, s, 2) })
	waitFor(t, "nothing left of the claimed members", func() string { return leftOfMembers(t, s, members) })
}

// claimedMember is the member labelled claimed that is none of before (members of
// earlier claims may still be on their way out).
func claimedMember(t testing.TB, s *stack.Stack, before []string) string {
	t.Helper()
	var member string
	waitFor(t, "a member labelled claimed", func() string {
		for _, id := range strings.Fields(s.MustCtr(t, "container", "ls", "-q")) {
			if slices.Contains(before, id) {
				continue
			}
			if info, err := s.Ctr("container", "info", id); err == nil && strings.Contains(info, `"dev.tidepool.member-state": "claimed"`) {
				member = id
				return ""
			}
		}
		return "none yet"
	})
	return member
}

// snapshotUpper finds a snapshot's id in its mounts: its upper directory's.
var snapshotUpper = regexp.MustCompile(`upperdir=[^,]*/snapshots/([0-9]+)/fs`)

// slotUpper is the upper directory of the overlay on a member's slot.
func slotUpper(t testing.TB, s *stack.Stack, member string) string {
	t.Helper()
	m := snapshotUpper.FindStringSubmatch(s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "mounts", "/x", member))
	if m == nil {
		t.Fatalf("no snapshot id in the mounts of %s", member)
	}
	if !slotBound(t, s, m[0]) {
		t.Fatalf("no view on the slot of %s", member)
	}
	return filepath.Join(s.Root, "snapshots", m[1], "slot-fs")
}

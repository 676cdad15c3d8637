package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/opencontainers/image-spec/identity"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/kview"
	"github.com/tidepool-dev/tidepool/pool"
)

// TestPoolReconcilesCutShortCreate: a tidepoold killed while it makes a member can
// leave the member's snapshot prepared and no container holding it (containerd's
// client makes the snapshot, then the container). The next tidepoold removes that
// snapshot (and its slot) and the creation's lease, so nothing of the member is left;
// the state is made here exactly as Pool.create leaves it at that point.
func TestPoolReconcilesCutShortCreate(t *testing.T) {
	s := busyboxPoolStack(t, 1)
	waitPool(t, s, "bb", 1)

	ctx := s.C.Context(context.Background())
	cl, err := s.C.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	image, err := cl.GetImage(ctx, imagebuild.BusyboxRef)
	if err != nil {
		t.Fatal(err)
	}
	diffs, err := image.RootFS(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id := pool.MemberIDPrefix + "bb-cutshort0001"
	lctx, _, err := cl.WithLease(ctx, leases.WithID(id), leases.WithExpiration(time.Hour),
		leases.WithLabels(map[string]string{pool.LabelMember: id}))
	if err != nil {
		t.Fatal(err)
	}
	labels := map[string]string{binding.LabelLateBind: "true", binding.LabelWorkdir: "/src"}
	slot := os.Getenv("TIDEPOOL_VIEWS_MODE") != "fuse" && kview.Probe(t.TempDir()) == nil
	if slot {
		labels[binding.LabelSlot] = "true"
	}
	if _, err := cl.SnapshotService("tidepool").Prepare(lctx, id, identity.ChainID(diffs).String(), snapshots.WithLabels(labels)); err != nil {
		t.Fatal(err)
	}
	slots := func() int { ents, _ := os.ReadDir(filepath.Join(s.Root, "slots")); return len(ents) }
	if slot && slots() != 2 {
		t.Fatalf("%d slots, want the member's and the cut-short one's", slots())
	}

	if err := s.Daemon.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := s.Daemon.Start(context.Background()); err != nil {
		t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
	}
	waitFor(t, "the cut-short member's snapshot and lease removed", func() string {
		if out := s.MustCtr(t, "snapshot", "--snapshotter", "tidepool", "ls"); strings.Contains(out, id) {
			return "snapshot left:\n" + out
		}
		if out := s.MustCtr(t, "leases", "ls"); strings.Contains(out, id) {
			return "lease left:\n" + out
		}
		return ""
	})
	waitPool(t, s, "bb", 1)
	waitFor(t, "only the member left", func() string {
		if slot && slots() != 1 {
			return "slots left"
		}
		return checkOnlyMembers(t, s, 1)
	})
}

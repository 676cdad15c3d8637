package faults

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// TestKillPull SIGKILLs `tidepool pull` at random points: while its pack streams
// into the store's journal, while the journal is synced, while the objects are
// written under their names and while they settle. Guarantees: fsck is clean after
// every kill (nothing half-written under an object's name); the next pull completes,
// keeping what the killed one journaled (the dead journal is replayed), and a
// checkout of the root matches the source; no journal or temp file is left after it.
func TestKillPull(t *testing.T) {
	e := newEnv(t)
	srv := s3test.Start(t)
	r := seed(t)
	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, r, src, 3000, 32<<10)
	rem := []string{"--remote", "s3://" + srv.Bucket + "/kill", "--remote-endpoint", srv.Endpoint()}
	pull := func(root string) []string { return append(append([]string{}, rem...), "pull", root) }

	ref := &env{t: t, bin: e.bin, root: filepath.Join(t.TempDir(), "ref")}
	root := lastLine(ref.must("ingest", src))
	ref.must(append(append([]string{}, rem...), "push", root)...)
	fresh := &env{t: t, bin: e.bin, root: filepath.Join(t.TempDir(), "fresh")}
	_, pullTime := fresh.timed(pull(root)...)
	t.Logf("undisturbed pull (with settling): %v", pullTime)

	present := regexp.MustCompile(`fetched, (\d+) present`)
	killed, resumed := 0, 0
	for i := 0; i < points/2; i++ {
		// Half the points within the first fifth of the pull, where the pack streams
		// into the journal (the rest of the time is the objects reaching their names).
		span := pullTime * 12 / 10
		if i%2 == 0 {
			span = pullTime / 5
		}
		delay := time.Duration(r.Int63n(int64(span) + 1))
		k, _, _ := e.killAt(delay, pull(root)...)
		if k {
			killed++
		}
		e.fsck("after a killed pull")
		c := e.cmd(t.Context(), pull(root)...)
		var out, errb bytes.Buffer
		c.Stdout, c.Stderr = &out, &errb
		if err := c.Run(); err != nil {
			t.Fatalf("kill point %d (%v): re-run of the pull: %v: %s", i, delay, err, errb.String())
		}
		if got := lastLine(out.String()); got != root {
			t.Fatalf("kill point %d: re-run pulled %s, want %s", i, got, root)
		}
		kept := 0
		if m := present.FindStringSubmatch(errb.String()); m != nil {
			kept, _ = strconv.Atoi(m[1])
		}
		if kept > 1 { // H("") is always present
			resumed++
		}
		t.Logf("kill point %d at %v (killed: %v): the re-run found %d objects present", i, delay, k, kept)
		e.fsck("after the re-run")
		if left := e.tempFiles(); len(left) > 1 || len(left) == 1 && left[0] != "journal" {
			t.Fatalf("kill point %d: temp files left after the re-run: %v", i, left)
		}
		if js, _ := os.ReadDir(filepath.Join(e.root, "cas", ".tidepool-tmp", "journal")); len(js) != 0 {
			t.Fatalf("kill point %d: journals left after the re-run: %d", i, len(js))
		}
		dst := filepath.Join(t.TempDir(), "co")
		e.must("checkout", root, dst)
		sameFiles(t, src, dst)
		// Start the next point from an empty store again (the root is no fork: a
		// collection with no grace removes it all).
		e.must("gc", "--grace", "0")
	}
	t.Logf("%d kill points, %d killed mid-pull, %d re-runs kept objects of the killed pull", points/2, killed, resumed)
	if killed == 0 {
		t.Fatal("no kill point landed while the pull ran")
	}
}

// sameFiles fails unless every regular file under want is in got with the same bytes.
func sameFiles(t *testing.T, want, got string) {
	t.Helper()
	err := filepath.WalkDir(want, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		rel, _ := filepath.Rel(want, p)
		a, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		b, err := os.ReadFile(filepath.Join(got, rel))
		if err != nil {
			return err
		}
		if !bytes.Equal(a, b) {
			t.Fatalf("%s differs after checkout", rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

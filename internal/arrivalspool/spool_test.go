package arrivalspool

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
)

func hashOf(s string) casstore.Hash { return casstore.Sum([]byte(s)) }

// age sets a record's time (its mtime) to d ago.
func age(t *testing.T, root string, h casstore.Hash, d time.Duration) {
	t.Helper()
	at := time.Now().Add(-d)
	if err := os.Chtimes(filepath.Join(Dir(root), h.String()), at, at); err != nil {
		t.Fatal(err)
	}
}

func TestTakeNewestFirstAndEmpties(t *testing.T) {
	root, store := t.TempDir(), t.TempDir()
	a, b, c := hashOf("a"), hashOf("b"), hashOf("c")
	for _, h := range []casstore.Hash{a, b, c} {
		if err := Add(root, store, h); err != nil {
			t.Fatal(err)
		}
	}
	age(t, root, a, 3*time.Minute)
	age(t, root, b, time.Minute)
	age(t, root, c, 2*time.Minute)
	info, err := os.Stat(Dir(root))
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o700 {
		t.Fatalf("spool mode %v, want 0700", info.Mode().Perm())
	}
	roots, skipped, err := Take(root, store, 2)
	if err != nil || skipped != 0 {
		t.Fatalf("Take: %v (%d skipped)", err, skipped)
	}
	if len(roots) != 2 || roots[0] != b || roots[1] != c {
		t.Fatalf("Take gave %v, want b then c (newest first, at most 2)", roots)
	}
	// Every record is gone, also the one beyond max.
	if recs, _, err := Take(root, store, 10); err != nil || len(recs) != 0 {
		t.Fatalf("second Take: %+v, %v", recs, err)
	}
}

func TestRemoveDelivered(t *testing.T) {
	root, store := t.TempDir(), t.TempDir()
	h := hashOf("x")
	if err := Remove(root, h); err != nil {
		t.Fatalf("Remove of no record: %v", err)
	}
	if err := Add(root, store, h); err != nil {
		t.Fatal(err)
	}
	if err := Remove(root, h); err != nil {
		t.Fatal(err)
	}
	if recs, _, err := Take(root, store, 10); err != nil || len(recs) != 0 {
		t.Fatalf("Take after Remove: %+v, %v", recs, err)
	}
}

func TestTakeNoSpool(t *testing.T) {
	recs, skipped, err := Take(t.TempDir(), t.TempDir(), 10)
	if err != nil || len(recs) != 0 || skipped != 0 {
		t.Fatalf("Take of no spool: %+v, %d, %v", recs, skipped, err)
	}
}

// Files that are no record of this store are skipped and removed: another store's,
// names that are no hash, a hash named symlink, a record whose store is gone.
func TestTakeSkipsWhatIsNoRecord(t *testing.T) {
	root, store, other := t.TempDir(), t.TempDir(), t.TempDir()
	mine, theirs, gone := hashOf("mine"), hashOf("theirs"), hashOf("gone")
	if err := Add(root, store, mine); err != nil {
		t.Fatal(err)
	}
	if err := Add(root, other, theirs); err != nil {
		t.Fatal(err)
	}
	vanished := filepath.Join(t.TempDir(), "cas")
	if err := os.Mkdir(vanished, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := Add(root, vanished, gone); err != nil {
		t.Fatal(err)
	}
	os.Remove(vanished)
	dir := Dir(root)
	for name, content := range map[string]string{
		"../escape":                  store,
		"not-a-hash":                 store,
		"ABCDEF" + mine.String()[6:]: store, // upper case: not a hash this store names
	} {
		_ = os.WriteFile(filepath.Join(dir, filepath.Base(name)), []byte(content), 0o600)
	}
	if err := os.Symlink(filepath.Join(dir, mine.String()), filepath.Join(dir, hashOf("link").String())); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, hashOf("huge").String()), make([]byte, maxStorePath+1), 0o600); err != nil {
		t.Fatal(err)
	}
	recs, skipped, err := Take(root, store, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || recs[0] != mine {
		t.Fatalf("Take gave %v, want only mine", recs)
	}
	if skipped != 7 {
		t.Fatalf("skipped %d, want 7", skipped)
	}
	left, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 0 {
		t.Fatalf("left in the spool: %v", left)
	}
}

// A temp file of an interrupted Add stays while it may still be renamed, and goes
// once it is stale.
func TestTakeRemovesStaleTemps(t *testing.T) {
	root, store := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(Dir(root), 0o700); err != nil {
		t.Fatal(err)
	}
	fresh, stale := filepath.Join(Dir(root), ".tmp-1"), filepath.Join(Dir(root), ".tmp-2")
	for _, p := range []string{fresh, stale} {
		if err := os.WriteFile(p, []byte(store), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-2 * staleTemp)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	if _, skipped, err := Take(root, store, 10); err != nil || skipped != 0 {
		t.Fatalf("Take: %v (%d skipped)", err, skipped)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Fatalf("a fresh temp file was removed: %v", err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("a stale temp file stayed: %v", err)
	}
}

// A root that does not exist is not created for a record.
func TestAddNeedsRoot(t *testing.T) {
	root := filepath.Join(t.TempDir(), "none")
	if err := Add(root, t.TempDir(), hashOf("a")); err == nil {
		t.Fatal("Add made a Tidepool root")
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Fatalf("root: %v", err)
	}
}

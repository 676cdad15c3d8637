package casstore_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
)

func modeOf(t *testing.T, p string) (os.FileMode, uint32) {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm(), st.Sys().(*syscall.Stat_t).Uid
}

// TestNewStoreIsPrivate: a store Open creates, its parents (Tidepool's ROOT), its
// fan-out and temp directories are 0700, objects 0600.
func TestNewStoreIsPrivate(t *testing.T) {
	root := filepath.Join(t.TempDir(), "root")
	s, err := casstore.Open(filepath.Join(root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.PutBytes([]byte("secret\n"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{root, s.Root(), filepath.Join(s.Root(), ".tidepool-tmp"), filepath.Dir(s.Path(h))} {
		if m, _ := modeOf(t, p); m != 0o700 {
			t.Errorf("%s has mode %o, want 0700", p, m)
		}
	}
	if m, _ := modeOf(t, s.Path(h)); m&0o077 != 0 {
		t.Errorf("object has mode %o, want no access for others", m)
	}
}

// TestExistingLunarStoreKeepsItsOwner: root writing into another user's existing
// store (a LunarFS store given with --store) leaves what it adds to that user,
// with the store's modes, so LunarFS keeps working there.
func TestExistingLunarStoreKeepsItsOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to own a store as another user")
	}
	dir := filepath.Join(t.TempDir(), "cas")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	s, err := casstore.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.PutBytes([]byte("lunar\n"))
	if err != nil {
		t.Fatal(err)
	}
	if m, uid := modeOf(t, dir); m != 0o755 || uid != 1000 {
		t.Errorf("store root changed to mode %o uid %d", m, uid)
	}
	if m, uid := modeOf(t, filepath.Dir(s.Path(h))); m != 0o755 || uid != 1000 {
		t.Errorf("new fan-out dir: mode %o uid %d, want 0755 uid 1000", m, uid)
	}
	if m, uid := modeOf(t, s.Path(h)); m != 0o644 || uid != 1000 {
		t.Errorf("new object: mode %o uid %d, want 0644 uid 1000", m, uid)
	}
}

package ingest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// TestReadHook: Read runs once, after every file was read and before Record, and
// what the source does after it does not reach the result.
func TestReadHook(t *testing.T) {
	s := casstoretest.NewStore(t)
	base := mustDir(t, s, t.TempDir(), Options{})
	u := t.TempDir()
	for i := 0; i < 50; i++ {
		writeFile(t, filepath.Join(u, "d", string(rune('a'+i%26))+string(rune('a'+i/26))), "before", 0o644)
	}
	var order []string
	opts := Options{
		Read: func() {
			order = append(order, "read")
			// The source changes as soon as it is let go.
			writeFile(t, filepath.Join(u, "d", "aa"), "after", 0o644)
			writeFile(t, filepath.Join(u, "late"), "late", 0o644)
		},
		Record: func(casstore.Hash) error { order = append(order, "record"); return nil },
	}
	h, err := Upper(t.Context(), s, base, u, "", opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(order) != 2 || order[0] != "read" || order[1] != "record" {
		t.Fatalf("hook order %v", order)
	}
	// The result is the source as it was before Read.
	writeFile(t, filepath.Join(u, "d", "aa"), "before", 0o644)
	rm(t, filepath.Join(u, "late"))
	want, err := Upper(t.Context(), s, base, u, "", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if h != want {
		t.Fatalf("changes made after Read reached the root: %s, want %s", h, want)
	}
	// Buffered in memory, the same root, and nothing was staged before Read.
	// (A fresh store: every object is new there.)
	s2 := casstoretest.NewStore(t)
	base2 := mustDir(t, s2, t.TempDir(), Options{})
	staged := -1
	hb, err := Upper(t.Context(), s2, base2, u, "", Options{BufferBytes: 1 << 20, Read: func() {
		ents, err := os.ReadDir(filepath.Join(s2.Root(), ".tidepool-tmp"))
		if err != nil {
			t.Error(err)
		}
		staged = len(ents)
	}})
	if err != nil || hb != want || staged != 0 {
		t.Fatalf("buffered: %s %v (want %s), %d temp files at Read", hb, err, want, staged)
	}
	// A walk that fails never calls Read.
	called := false
	if _, err := Upper(t.Context(), s, base, filepath.Join(u, "nope"), "", Options{Read: func() { called = true }}); err == nil || called {
		t.Fatalf("failed walk: err %v, Read called %v", err, called)
	}
}

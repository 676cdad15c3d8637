package casstore

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// TestBufferedBatch: buffered objects touch no file until Flush or Commit, are
// found by the batch meanwhile, land whole at Commit, and vanish on Abort; past the
// limit objects are staged on disk as usual.
func TestBufferedBatch(t *testing.T) {
	s := newStore(t)
	tmpFiles := func() int {
		ents, _ := os.ReadDir(filepath.Join(s.Root(), tmpDirName))
		return len(ents)
	}
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Buffer(100)
	var hs []Hash
	for i := 0; i < 10; i++ {
		h, err := b.PutBytes([]byte(fmt.Sprintf("object %02d", i))) // 9 bytes each
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	if n := tmpFiles(); n != 0 {
		t.Fatalf("%d temp files while buffering", n)
	}
	// Past the limit (90 + 32 > 100): on disk at once.
	if _, err := b.PutBytes([]byte("object number 10, past the limit")); err != nil {
		t.Fatal(err)
	}
	if n := tmpFiles(); n != 1 {
		t.Fatalf("%d temp files past the limit", n)
	}
	if !b.have(hs[3]) {
		t.Fatal("a buffered object is not found by its batch")
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	for i, h := range hs {
		got, err := s.ReadAll(h, 1<<20)
		if err != nil || string(got) != fmt.Sprintf("object %02d", i) {
			t.Fatalf("object %d: %q %v", i, got, err)
		}
	}
	if n := tmpFiles(); n != 0 {
		t.Fatalf("%d temp files after commit", n)
	}

	before := countObjects(t, s)
	b, err = s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Buffer(1 << 20)
	b.PutBytes([]byte("never stored"))
	b.Abort()
	if after := countObjects(t, s); after != before {
		t.Fatalf("objects %d -> %d after an aborted buffered batch", before, after)
	}
}

package casstore

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// TestJournaledBatch: a buffered batch whose objects are all in memory journals
// them, publishes them at once, and once settled has synced them, recorded their
// sizes and dropped the journal.
func TestJournaledBatch(t *testing.T) {
	s := newStore(t)
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Buffer(1 << 20)
	var hs []Hash
	for i := 0; i < 20; i++ {
		h, err := b.PutBytes([]byte(fmt.Sprintf("journaled object %02d", i)))
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	for i, h := range hs {
		got, err := s.ReadAll(h, 1<<20)
		if err != nil || string(got) != fmt.Sprintf("journaled object %02d", i) {
			t.Fatalf("object %d right after commit: %q %v", i, got, err)
		}
	}
	s.Settle()
	if js, err := s.Journals(); err != nil || len(js) != 0 {
		t.Fatalf("journals after settling: %v %v", js, err)
	}
	if err := s.RefreshSizes(); err != nil {
		t.Fatal(err)
	}
	for _, h := range hs {
		if n, ok := s.KnownSize(h); !ok || n != int64(len("journaled object 00")) {
			t.Fatalf("size of %s: %d %v", h, n, ok)
		}
	}
}

// writeDeadJournal writes a journal as a writer that no longer runs left it: the
// entries, then tail appended raw.
func writeDeadJournal(t *testing.T, s *Store, objects [][]byte, tail []byte) string {
	t.Helper()
	if err := os.MkdirAll(s.journalDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(s.journalDir(), "jnl-999999999.1-x")
	buf := []byte(journalMagic)
	for _, o := range objects {
		buf = appendRawEntry(buf, Sum(o), o)
	}
	buf = append(buf, tail...)
	if err := os.WriteFile(p, buf, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// appendRawEntry appends a journal entry (the current format) holding data as it is
// under the name h.
func appendRawEntry(b []byte, h Hash, data []byte) []byte {
	b = append(b, h[:]...)
	b = binary.BigEndian.AppendUint64(b, uint64(len(data)))
	b = binary.BigEndian.AppendUint64(b, uint64(len(data)))
	return append(b, data...)
}

// TestReplayDeadJournal: after a crash, the journal of a writer that died restores
// its objects that are missing or torn, leaves right ones, stops at a torn tail, and
// goes; a live writer's journal is left alone.
func TestReplayDeadJournal(t *testing.T) {
	s := newStore(t)
	missing, torn, fine, afterTear := []byte("missing object"), []byte("torn object"), []byte("fine object"), []byte("never whole")
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.PutBytes(fine); err != nil {
		t.Fatal(err)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	tornPath := s.Path(Sum(torn))
	os.MkdirAll(filepath.Dir(tornPath), 0o700)
	if err := os.WriteFile(tornPath, []byte("torn"), 0o600); err != nil { // a torn write under its name
		t.Fatal(err)
	}
	// The tail: an entry header whose bytes do not hash to its name.
	h := Sum(afterTear)
	tail := append(append([]byte{}, h[:]...), 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 4)
	tail = append(tail, []byte("nev")...)
	j := writeDeadJournal(t, s, [][]byte{missing, torn, fine}, tail)

	live := filepath.Join(s.journalDir(), "jnl-"+tempPrefix()[4:]+"live")
	if err := os.WriteFile(live, []byte(journalMagic), 0o600); err != nil {
		t.Fatal(err)
	}
	n, err := s.ReplayDeadJournals()
	if err != nil || n != 2 {
		t.Fatalf("replay: %d objects, %v; want 2 restored", n, err)
	}
	for _, o := range [][]byte{missing, torn, fine} {
		got, err := s.ReadAll(Sum(o), 1<<20)
		if err != nil || string(got) != string(o) {
			t.Fatalf("after replay %q reads %q, %v", o, got, err)
		}
	}
	if ok, _ := s.Has(Sum(afterTear)); ok {
		t.Fatal("an entry past the torn tail was restored")
	}
	if _, err := os.Stat(j); !os.IsNotExist(err) {
		t.Fatalf("replayed journal still there: %v", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Fatalf("a live writer's journal was touched: %v", err)
	}
	// Idempotent: nothing left to do.
	if n, err := s.ReplayDeadJournals(); err != nil || n != 0 {
		t.Fatalf("second replay: %d, %v", n, err)
	}
	// A garbage journal (torn before its magic) is dropped, restoring nothing.
	g := filepath.Join(s.journalDir(), "jnl-999999999.1-g")
	os.WriteFile(g, []byte("TPJ"), 0o600)
	if n, err := s.ReplayDeadJournals(); err != nil || n != 0 {
		t.Fatalf("garbage journal: %d, %v", n, err)
	}
	if _, err := os.Stat(g); !os.IsNotExist(err) {
		t.Fatal("garbage journal kept")
	}
}

// TestFirstBatchReplays: the first batch a process starts in a store replays what
// dead writers left, before it writes.
func TestFirstBatchReplays(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cas")
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	obj := []byte("left in a journal")
	writeDeadJournal(t, s, [][]byte{obj}, nil)
	s2, err := Open(dir) // a new process's view of the store
	if err != nil {
		t.Fatal(err)
	}
	b, err := s2.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Abort()
	if got, err := s2.ReadAll(Sum(obj), 1<<20); err != nil || string(got) != string(obj) {
		t.Fatalf("after the first batch: %q, %v", got, err)
	}
}

// TestReplayJournalFormats: a dead writer's journal in the format of an earlier
// version (no stored length, TPJRNL1) replays, and so does one holding compressed
// entries (a pull's), each object decoded and checked; a compressed entry that does
// not decode, or decodes to bytes that do not hash to its name, ends the replay and
// is never written under its name.
func TestReplayJournalFormats(t *testing.T) {
	src := bytes.Repeat([]byte("a line of source code, compressible;\n"), 500)
	block := CompressObject(nil, src)
	if block == nil || len(block) >= len(src) {
		t.Fatalf("compressible object not compressed: %d bytes", len(block))
	}
	compressed := func(b []byte, h Hash, size int64, block []byte) []byte {
		b = append(b, h[:]...)
		b = binary.BigEndian.AppendUint64(b, uint64(size))
		b = binary.BigEndian.AppendUint64(b, uint64(len(block)))
		return append(b, block...)
	}
	other := bytes.Repeat([]byte("other compressible content\n"), 300)
	for _, tc := range []struct {
		name    string
		journal func() []byte
		want    [][]byte // restored
		never   []Hash
	}{
		{"v1", func() []byte {
			b := []byte(journalMagicV1)
			for _, o := range [][]byte{[]byte("old format one"), src} {
				h := Sum(o)
				b = append(b, h[:]...)
				b = binary.BigEndian.AppendUint64(b, uint64(len(o)))
				b = append(b, o...)
			}
			return b
		}, [][]byte{[]byte("old format one"), src}, nil},
		{"compressed", func() []byte {
			b := appendRawEntry([]byte(journalMagic), Sum([]byte("raw")), []byte("raw"))
			return compressed(b, Sum(src), int64(len(src)), block)
		}, [][]byte{[]byte("raw"), src}, nil},
		{"compressed-wrong-name", func() []byte {
			b := appendRawEntry([]byte(journalMagic), Sum([]byte("raw")), []byte("raw"))
			b = compressed(b, Sum(other), int64(len(src)), block)
			return appendRawEntry(b, Sum([]byte("after")), []byte("after"))
		}, [][]byte{[]byte("raw")}, []Hash{Sum(other), Sum([]byte("after"))}},
		{"compressed-garbage", func() []byte {
			bad := append([]byte{}, block...)
			for i := len(bad) / 2; i < len(bad); i++ {
				bad[i] = 0xff
			}
			return compressed([]byte(journalMagic), Sum(src), int64(len(src)), bad)
		}, nil, []Hash{Sum(src)}},
		{"compressed-wrong-size", func() []byte {
			return compressed([]byte(journalMagic), Sum(src), int64(len(src))+1, block)
		}, nil, []Hash{Sum(src)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t)
			if err := os.MkdirAll(s.journalDir(), 0o700); err != nil {
				t.Fatal(err)
			}
			p := filepath.Join(s.journalDir(), "jnl-999999999.1-"+tc.name)
			if err := os.WriteFile(p, tc.journal(), 0o600); err != nil {
				t.Fatal(err)
			}
			n, err := s.ReplayDeadJournals()
			if err != nil || n != len(tc.want) {
				t.Fatalf("replay: %d objects, %v; want %d", n, err, len(tc.want))
			}
			for _, o := range tc.want {
				if err := s.Verify(Sum(o)); err != nil {
					t.Fatal(err)
				}
			}
			for _, h := range tc.never {
				if ok, err := s.Has(h); ok || err != nil {
					t.Fatalf("object %s restored from a bad entry: %v, %v", h, ok, err)
				}
			}
			if _, err := os.Stat(p); !os.IsNotExist(err) {
				t.Fatalf("replayed journal still there: %v", err)
			}
		})
	}
}

package casstore

import (
	"bytes"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func refresh(t *testing.T, s *Store) {
	t.Helper()
	if err := s.RefreshSizes(); err != nil {
		t.Fatal(err)
	}
}

func wantSize(t *testing.T, s *Store, h Hash, want int64, known bool) {
	t.Helper()
	got, ok := s.KnownSize(h)
	if ok != known || (known && got != want) {
		t.Fatalf("KnownSize(%s) = %d, %v; want %d, %v", h.Short(), got, ok, want, known)
	}
}

// compact compacts s's size index as garbage collection does, under the store's
// exclusive lock.
func compact(t *testing.T, s *Store) {
	t.Helper()
	unlock, err := s.LockExclusive()
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if err := s.CompactSizes(); err != nil {
		t.Fatal(err)
	}
}

func appendRaw(t *testing.T, s *Store, b []byte) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(s.Root(), sizeIndexName), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		t.Fatal(err)
	}
}

// TestSizeIndexRecordsEveryWritePath: every way an object enters the store records
// its size (bytes, streams, small and large files, expected transfers), an aborted
// batch records nothing, and an object stored by someone else (LunarFS) is unknown.
func TestSizeIndexRecordsEveryWritePath(t *testing.T) {
	s := newStore(t)
	small := []byte("hello")
	hSmall, err := s.PutBytes(small)
	if err != nil {
		t.Fatal(err)
	}
	stream := bytes.Repeat([]byte("s"), 3<<20)
	hStream, err := s.Put(bytes.NewReader(stream))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	large := bytes.Repeat([]byte("L"), smallFile+7)
	os.WriteFile(filepath.Join(dir, "large"), large, 0o644)
	os.WriteFile(filepath.Join(dir, "small"), []byte("a small file"), 0o644)
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	hLarge, _, err := b.PutFile(filepath.Join(dir, "large"))
	if err != nil {
		t.Fatal(err)
	}
	hFile, _, err := b.PutFile(filepath.Join(dir, "small"))
	if err != nil {
		t.Fatal(err)
	}
	moved := []byte("came from a remote")
	if _, err := b.PutExpect(bytes.NewReader(moved), Sum(moved)); err != nil {
		t.Fatal(err)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	// A buffered batch (a branch of a frozen container) keeps objects in memory
	// until Flush or Commit: both ways record sizes.
	b, err = s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Buffer(1 << 20)
	flushed, kept := []byte("buffered then flushed"), []byte("buffered until commit")
	if _, err := b.PutBytes(flushed); err != nil {
		t.Fatal(err)
	}
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.PutBytes(kept); err != nil {
		t.Fatal(err)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	aborted := []byte("never published")
	b, err = s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.PutBytes(aborted); err != nil {
		t.Fatal(err)
	}
	b.Abort()
	// An object written the way LunarFS writes (no batch, no index).
	foreign := []byte("written by lunar")
	hForeign := Sum(foreign)
	os.MkdirAll(filepath.Dir(s.Path(hForeign)), 0o700)
	os.WriteFile(s.Path(hForeign), foreign, 0o600)

	refresh(t, s)
	wantSize(t, s, hSmall, int64(len(small)), true)
	wantSize(t, s, hStream, int64(len(stream)), true)
	wantSize(t, s, hLarge, int64(len(large)), true)
	wantSize(t, s, hFile, 12, true)
	wantSize(t, s, Sum(moved), int64(len(moved)), true)
	wantSize(t, s, Sum(flushed), int64(len(flushed)), true)
	wantSize(t, s, Sum(kept), int64(len(kept)), true)
	wantSize(t, s, Sum(aborted), 0, false)
	wantSize(t, s, hForeign, 0, false)

	// Another process (another Store on the same directory) sees them, and sees what
	// this one appends later, incrementally.
	s2, err := Open(s.Root())
	if err != nil {
		t.Fatal(err)
	}
	refresh(t, s2)
	wantSize(t, s2, hLarge, int64(len(large)), true)
	later, _ := s.PutBytes([]byte("later"))
	refresh(t, s2)
	wantSize(t, s2, later, 5, true)
}

// TestSizeIndexNeverWrong: a torn record, garbage, and two records that disagree
// all leave the hash unknown (the caller stats), never a wrong size; a writer after
// a torn tail keeps its records aligned.
func TestSizeIndexNeverWrong(t *testing.T) {
	s := newStore(t)
	h1, _ := s.PutBytes([]byte("one"))
	// A crash in the middle of an append: a record cut short, its size field half
	// written.
	victim := Sum([]byte("victim"))
	rec := appendSizeRecord(nil, victim, 6)
	appendRaw(t, s, rec[:37])
	refresh(t, s) // reads up to the last whole record, and stops before the torn one
	wantSize(t, s, h1, 3, true)
	wantSize(t, s, victim, 0, false)
	// The next writer pads the torn record out; its own records stay readable.
	h2, _ := s.PutBytes([]byte("two!"))
	refresh(t, s)
	wantSize(t, s, h2, 4, true)
	wantSize(t, s, victim, 0, false)
	st, _ := os.Stat(filepath.Join(s.Root(), sizeIndexName))
	if st.Size()%sizeRecordLen != 0 {
		t.Fatalf("index is %d bytes, not whole records", st.Size())
	}

	// Garbage and zeros (what a crash can leave in a file's tail) are skipped.
	junk := make([]byte, 5*sizeRecordLen)
	rand.Read(junk[:3*sizeRecordLen])
	appendRaw(t, s, junk)
	// A well-formed record with a wrong size for h1 makes h1 unknown, not wrong.
	appendRaw(t, s, appendSizeRecord(nil, h1, 4096))
	// So does a nonsense size.
	appendRaw(t, s, appendSizeRecord(nil, h2, 1<<63))
	h3, _ := s.PutBytes([]byte("three"))
	refresh(t, s)
	wantSize(t, s, h1, 0, false)
	wantSize(t, s, h2, 0, false)
	wantSize(t, s, h3, 5, true)

	// A record whose check does not match is ignored even if its size is sane.
	bad := appendSizeRecord(nil, Sum([]byte("bad")), 3)
	bad[47] ^= 1
	appendRaw(t, s, bad)
	refresh(t, s)
	wantSize(t, s, Sum([]byte("bad")), 0, false)
}

// TestSizeIndexForgetAndCompact: forgotten objects are unknown until stored again;
// compaction keeps exactly the live entries and readers follow the new file.
func TestSizeIndexForgetAndCompact(t *testing.T) {
	s := newStore(t)
	var hs []Hash
	for i := range 1500 {
		h, err := s.PutBytes([]byte(strings.Repeat("x", i+1)))
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	refresh(t, s)
	reader, _ := Open(s.Root())
	refresh(t, reader)
	if err := s.ForgetSizes(hs[:1000]); err != nil {
		t.Fatal(err)
	}
	refresh(t, s)
	wantSize(t, s, hs[0], 0, false)
	wantSize(t, s, hs[1200], 1201, true)
	if _, err := s.PutBytes([]byte("x")); err != nil { // hs[0] comes back... but it exists: reused, not rewritten
		t.Fatal(err)
	}
	os.Remove(s.Path(hs[1]))
	if _, err := s.PutBytes([]byte("xx")); err != nil { // hs[1] is stored again
		t.Fatal(err)
	}
	refresh(t, s)
	wantSize(t, s, hs[0], 0, false)
	wantSize(t, s, hs[1], 2, true)

	before, _ := os.Stat(filepath.Join(s.Root(), sizeIndexName))
	compact(t, s)
	after, _ := os.Stat(filepath.Join(s.Root(), sizeIndexName))
	// 501 live entries, after compaction's own first record.
	if want := int64((1 + 501) * sizeRecordLen); after.Size() != want || os.SameFile(before, after) {
		t.Fatalf("compacted index: %d bytes (same file: %v), want %d in a new file", after.Size(), os.SameFile(before, after), want)
	}
	for _, st := range []*Store{s, reader} {
		refresh(t, st)
		wantSize(t, st, hs[0], 0, false)
		wantSize(t, st, hs[1], 2, true)
		wantSize(t, st, hs[999], 0, false)
		wantSize(t, st, hs[1499], 1500, true)
	}
	// Losing the index loses nothing but speed.
	os.Remove(filepath.Join(s.Root(), sizeIndexName))
	refresh(t, s)
	wantSize(t, s, hs[1499], 0, false)
}

// TestSizeEpoch: the epoch stays while records only add entries, and moves with every
// record that forgets or spoils one and with every new index file.
func TestSizeEpoch(t *testing.T) {
	s := newStore(t)
	refresh(t, s)
	if _, ok := s.SizeEpoch(); ok {
		t.Fatal("an epoch without an index")
	}
	h1, _ := s.PutBytes([]byte("one"))
	refresh(t, s)
	e, ok := s.SizeEpoch()
	if !ok {
		t.Fatal("no epoch with an index")
	}
	moved := func(why string, want bool) {
		t.Helper()
		refresh(t, s)
		got, ok := s.SizeEpoch()
		if !ok || (got != e) != want {
			t.Fatalf("%s: epoch moved %v (ok %v), want moved %v", why, got != e, ok, want)
		}
		e = got
	}
	h2, _ := s.PutBytes([]byte("two!"))
	moved("an entry added", false)
	appendRaw(t, s, appendSizeRecord(nil, h2, 4)) // the same entry again
	moved("an entry repeated", false)
	appendRaw(t, s, appendSizeRecord(nil, h2, 5))
	moved("an entry spoiled", true)
	if err := s.ForgetSizes([]Hash{h1}); err != nil {
		t.Fatal(err)
	}
	moved("an entry forgotten", true)
	for i := range 1100 {
		if _, err := s.PutBytes([]byte(strings.Repeat("y", i+1))); err != nil {
			t.Fatal(err)
		}
	}
	moved("entries added", false)
	var hs []Hash
	for i := range 1100 {
		hs = append(hs, Sum([]byte(strings.Repeat("y", i+1))))
	}
	if err := s.ForgetSizes(hs); err != nil {
		t.Fatal(err)
	}
	moved("entries forgotten", true)
	compact(t, s)
	moved("the index compacted", true)
}

// TestSizeIndexReplacedInPlace: a reader tells a new index file that has the inode
// number of the one it read (ext4 reuses them: compacted twice between two refreshes)
// by its first record, and forgets what only the old file said.
func TestSizeIndexReplacedInPlace(t *testing.T) {
	s := newStore(t)
	old, _ := s.PutBytes([]byte("old"))
	refresh(t, s)
	e, _ := s.SizeEpoch()
	wantSize(t, s, old, 3, true)
	// What a compaction writes, but into the same inode, and longer than what the
	// reader read: another first record, then entries that do not name old.
	var nonce Hash
	rand.Read(nonce[:])
	b := appendSizeRecord(nil, nonce, sizeForgotten)
	newer := Sum([]byte("newer"))
	b = appendSizeRecord(b, newer, 5)
	b = appendSizeRecord(b, newer, 5)
	if err := os.WriteFile(filepath.Join(s.Root(), sizeIndexName), b, 0o600); err != nil {
		t.Fatal(err)
	}
	refresh(t, s)
	wantSize(t, s, old, 0, false)
	wantSize(t, s, newer, 5, true)
	if got, _ := s.SizeEpoch(); got == e {
		t.Fatal("the epoch did not move with a new index file")
	}
}

package casstore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// streamObjects makes n small objects and two big ones (streamed with PutExpect).
func streamObjects(n int, tag string) (small, big [][]byte) {
	for i := 0; i < n; i++ {
		small = append(small, []byte(fmt.Sprintf("%s small object %d", tag, i)))
	}
	for i := 0; i < 2; i++ {
		big = append(big, bytes.Repeat([]byte(fmt.Sprintf("%s big %d|", tag, i)), 300_000))
	}
	return small, big
}

// writeStream commits small (from several goroutines) and big objects through a
// journal writer.
func writeStream(t *testing.T, s *Store, small, big [][]byte) {
	t.Helper()
	j, err := s.BeginJournal()
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(small))
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(small); i += 4 {
				errs <- j.PutBytesExpect(small[i], Sum(small[i]))
			}
		}()
	}
	for _, b := range big {
		if _, err := j.PutExpect(bytes.NewReader(b), Sum(b), int64(len(b))); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if j.Len() != len(small)+len(big) {
		t.Fatalf("journal holds %d objects, want %d", j.Len(), len(small)+len(big))
	}
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
}

// TestJournalWriterReadableAtOnce: once Commit returns, every object is readable
// through the store API while none is under its name yet; after settling all are
// in place, in the size index, and the journal is gone.
func TestJournalWriterReadableAtOnce(t *testing.T) {
	s := newStore(t)
	release := holdLatePublication(t)
	small, big := streamObjects(300, "readable")
	writeStream(t, s, small, big)
	all := append(append([][]byte{}, small...), big...)
	for _, data := range all {
		if _, err := os.Lstat(s.Path(Sum(data))); err == nil {
			t.Fatal("an object was under its name while its publication was held")
		}
	}
	for i, data := range all {
		h := Sum(data)
		switch i % 4 {
		case 0:
			if ok, err := s.Has(h); err != nil || !ok {
				t.Fatalf("Has(%s) = %v, %v", h, ok, err)
			}
		case 1:
			if n, err := s.Size(h); err != nil || n != int64(len(data)) {
				t.Fatalf("Size(%s) = %d, %v; want %d", h, n, err, len(data))
			}
		case 2:
			if got, err := s.ReadAll(h, 1<<30); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("ReadAll(%s): %d bytes, %v", h, len(got), err)
			}
		case 3:
			f, err := s.Open(h)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(f)
			f.Close()
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("Open(%s): %d bytes, %v", h, len(got), err)
			}
		}
	}
	release()
	s.Settle()
	if err := s.RefreshSizes(); err != nil {
		t.Fatal(err)
	}
	for _, data := range all {
		h := Sum(data)
		if err := s.Verify(h); err != nil {
			t.Fatal(err)
		}
		if n, ok := s.KnownSize(h); !ok || n != int64(len(data)) {
			t.Fatalf("size index: %s = %d, %v", h, n, ok)
		}
	}
	if js, err := s.Journals(); err != nil || len(js) != 0 {
		t.Fatalf("journals after settling: %v, %v", js, err)
	}
	if tmp, err := s.TempFiles(); err != nil || len(tmp) != 0 {
		t.Fatalf("temp files after settling: %v, %v", tmp, err)
	}
}

// TestJournalWriterRefuses: bytes that do not hash to their name, given whole or
// streamed, and a stream that ends early, leave nothing in the journal: it holds
// exactly the good entries, and nothing is ever stored under the refused names.
func TestJournalWriterRefuses(t *testing.T) {
	s := newStore(t)
	release := holdLatePublication(t)
	j, err := s.BeginJournal()
	if err != nil {
		t.Fatal(err)
	}
	good1 := []byte("first good object")
	good2 := bytes.Repeat([]byte("second good object, streamed "), 10_000)
	claimed := Sum([]byte("what the sender claimed"))
	var ce *CorruptError
	if err := j.PutBytesExpect([]byte("not what it claims"), claimed); !errors.As(err, &ce) {
		t.Fatalf("corrupt bytes: %v", err)
	}
	if err := j.PutBytesExpect(good1, Sum(good1)); err != nil {
		t.Fatal(err)
	}
	bad := bytes.Repeat([]byte("streamed, not what it claims "), 10_000)
	if _, err := j.PutExpect(bytes.NewReader(bad), claimed, int64(len(bad))); !errors.As(err, &ce) {
		t.Fatalf("corrupt stream: %v", err)
	}
	short := Sum(good2)
	if n, err := j.PutExpect(bytes.NewReader(good2[:1000]), short, int64(len(good2))); err == nil || errors.As(err, &ce) || n != 1000 {
		t.Fatalf("short stream: %d bytes, %v", n, err)
	}
	if _, err := j.PutExpect(bytes.NewReader(good2), Sum(good2), int64(len(good2))); err != nil {
		t.Fatal(err)
	}
	path := j.f.Name()
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(len(journalMagic) + 2*journalEntryHeader + len(good1) + len(good2)); st.Size() != want {
		t.Fatalf("journal is %d bytes, want %d (the good entries only)", st.Size(), want)
	}
	index := map[Hash]journalEntry{}
	if err := indexJournal(path, index); err != nil || len(index) != 2 {
		t.Fatalf("journal index: %v, %v", index, err)
	}
	release()
	s.Settle()
	if ok, err := s.Has(claimed); ok || err != nil {
		t.Fatalf("refused object stored: %v, %v", ok, err)
	}
	for _, b := range [][]byte{good1, good2} {
		if err := s.Verify(Sum(b)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestJournalWriterKilled: a writer killed before Commit leaves its journal, with a
// torn tail or a streamed entry not named yet; the next writer replays every whole
// entry (so a re-run need not fetch them again) and nothing else.
func TestJournalWriterKilled(t *testing.T) {
	for _, tail := range []string{"torn", "unnamed"} {
		t.Run(tail, func(t *testing.T) {
			s := newStore(t)
			j, err := s.BeginJournal()
			if err != nil {
				t.Fatal(err)
			}
			small, big := streamObjects(50, tail)
			for _, b := range small {
				if err := j.PutBytesExpect(b, Sum(b)); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := j.PutExpect(bytes.NewReader(big[0]), Sum(big[0]), int64(len(big[0]))); err != nil {
				t.Fatal(err)
			}
			raw, err := os.ReadFile(j.f.Name())
			if err != nil {
				t.Fatal(err)
			}
			j.Abort()
			last := big[1]
			var hdr [journalEntryHeader]byte
			if tail == "torn" {
				h := Sum(last)
				copy(hdr[:], h[:])
			} // else: the zero name a streamed entry has until it hashed right
			binary.BigEndian.PutUint64(hdr[HashSize:], uint64(len(last)))
			binary.BigEndian.PutUint64(hdr[HashSize+8:], uint64(len(last)))
			raw = append(append(raw, hdr[:]...), last[:len(last)/2]...)
			if tail == "unnamed" {
				raw = append(raw, last[len(last)/2:]...) // whole, but never named
			}
			if err := os.MkdirAll(s.journalDir(), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(s.journalDir(), "jnl-999999999.1-killed"), raw, 0o600); err != nil {
				t.Fatal(err)
			}
			n, err := s.ReplayDeadJournals()
			if err != nil || n != len(small)+1 {
				t.Fatalf("replay: %d objects, %v; want %d", n, err, len(small)+1)
			}
			for _, b := range append(small, big[0]) {
				if err := s.Verify(Sum(b)); err != nil {
					t.Fatal(err)
				}
			}
			if ok, _ := s.Has(Sum(last)); ok {
				t.Fatal("the entry cut off by the kill was stored")
			}
			count := 0
			if err := s.Walk(func(h Hash, _ string) error { count++; return s.Verify(h) }); err != nil {
				t.Fatal(err)
			}
			if count != len(small)+1 {
				t.Fatalf("%d objects in the store, want %d", count, len(small)+1)
			}
			if js, _ := s.Journals(); len(js) != 0 {
				t.Fatalf("journals left: %v", js)
			}
		})
	}
}

// TestJournalWriterSeenByOtherProcesses: a reader with a store of its own (another
// process) that looked at the journals while a pull was still writing finds the
// pull's objects once it committed, not the stale index of the unfinished journal.
func TestJournalWriterSeenByOtherProcesses(t *testing.T) {
	s := newStore(t)
	other, err := Open(s.Root())
	if err != nil {
		t.Fatal(err)
	}
	release := holdLatePublication(t)
	j, err := s.BeginJournal()
	if err != nil {
		t.Fatal(err)
	}
	first, second := []byte("written before the reader looked"), []byte("written after the reader looked")
	if _, err := j.PutExpect(bytes.NewReader(first), Sum(first), int64(len(first))); err != nil {
		t.Fatal(err)
	}
	if ok, err := other.Has(Sum(second)); ok || err != nil {
		t.Fatalf("Has before the object was written: %v, %v", ok, err)
	}
	if err := j.PutBytesExpect(second, Sum(second)); err != nil {
		t.Fatal(err)
	}
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
	for _, b := range [][]byte{first, second} {
		if got, err := other.ReadAll(Sum(b), 1<<20); err != nil || !bytes.Equal(got, b) {
			t.Fatalf("other process reads %q: %q, %v", b, got, err)
		}
	}
	release()
	s.Settle()
}

// TestHasAll: HasAll agrees with Has for objects in place, in this process's
// committed journal, in a dead writer's journal (whole or corrupt) and missing.
func TestHasAll(t *testing.T) {
	s := newStore(t)
	placed, err := s.PutBytes([]byte("in place"))
	if err != nil {
		t.Fatal(err)
	}
	dead := []byte("in a dead writer's journal")
	torn := []byte("corrupt in a dead writer's journal")
	raw := []byte(journalMagic)
	for _, b := range [][]byte{dead, torn} {
		raw = appendRawEntry(raw, Sum(b), b)
	}
	raw[len(raw)-1] ^= 0xff
	if err := os.MkdirAll(s.journalDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.journalDir(), "jnl-999999999.1-hasall"), raw, 0o600); err != nil {
		t.Fatal(err)
	}
	release := holdLatePublication(t)
	pulled := []byte("in this process's journal")
	j, err := s.BeginJournal() // no replay: this store's first batch (PutBytes) made it
	if err != nil {
		t.Fatal(err)
	}
	if err := j.PutBytesExpect(pulled, Sum(pulled)); err != nil {
		t.Fatal(err)
	}
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
	hs := []Hash{placed, Sum(pulled), Sum(dead), Sum(torn), Sum([]byte("nowhere"))}
	got, err := s.HasAll(hs)
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, true, true, false, false}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("HasAll = %v, want %v", got, want)
	}
	release()
	s.Settle()
}

// TestJournalWriterPutAll: a batch appends exactly its objects whose bytes hash to
// their names, in one journal entry each (more objects than one vectored write
// takes, empty ones, and one already in the journal among them); the others are
// refused and nothing of them is written. Then every object reads back whole.
func TestJournalWriterPutAll(t *testing.T) {
	s := newStore(t)
	release := holdLatePublication(t)
	j, err := s.BeginJournal()
	if err != nil {
		t.Fatal(err)
	}
	before := []byte("appended on its own first")
	if err := j.PutBytesExpect(before, Sum(before)); err != nil {
		t.Fatal(err)
	}
	var objs []Object
	var good [][]byte
	bad := map[Hash]bool{}
	for i := 0; i < 1500; i++ {
		data := []byte(fmt.Sprintf("batched object %d %s", i, bytes.Repeat([]byte{'x'}, i%97)))
		switch {
		case i%500 == 7:
			h := Sum([]byte(fmt.Sprintf("what sender %d claimed", i)))
			bad[h] = true
			objs = append(objs, Object{Hash: h, Data: data})
			continue
		case i == 3:
			data = nil
		}
		objs = append(objs, Object{Hash: Sum(data), Data: data})
		good = append(good, data)
	}
	objs = append(objs, Object{Hash: Sum(before), Data: before})
	refused, err := j.PutAllExpect(objs)
	if err != nil {
		t.Fatal(err)
	}
	if len(refused) != len(bad) {
		t.Fatalf("%d refused, want %d", len(refused), len(bad))
	}
	for _, ce := range refused {
		if !bad[ce.Hash] || ce.Got == ce.Hash {
			t.Fatalf("refused %s (got %s), not one of the corrupt objects", ce.Hash, ce.Got)
		}
	}
	if j.Len() != len(good)+1 {
		t.Fatalf("journal holds %d objects, want %d", j.Len(), len(good)+1)
	}
	path := j.f.Name()
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
	size := int64(len(journalMagic) + journalEntryHeader*(len(good)+1) + len(before))
	for _, g := range good {
		size += int64(len(g))
	}
	if st, err := os.Stat(path); err != nil || st.Size() != size {
		t.Fatalf("journal: %v, %v; want %d bytes (each good object once)", st, err, size)
	}
	index := map[Hash]journalEntry{}
	if err := indexJournal(path, index); err != nil || len(index) != len(good)+1 {
		t.Fatalf("journal index: %d entries, %v", len(index), err)
	}
	for _, g := range append(good, before) {
		if got, err := s.ReadAll(Sum(g), 1<<20); err != nil || !bytes.Equal(got, g) {
			t.Fatalf("ReadAll(%s): %q, %v", Sum(g), got, err)
		}
	}
	release()
	s.Settle()
	for h := range bad {
		if ok, err := s.Has(h); ok || err != nil {
			t.Fatalf("refused object %s stored: %v, %v", h, ok, err)
		}
	}
	for _, g := range good {
		if err := s.Verify(Sum(g)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEmpty: a store is empty until it holds an object, whether in place, in this
// process's journal not published yet, or in a dead writer's journal.
func TestEmpty(t *testing.T) {
	check := func(s *Store, want bool) {
		t.Helper()
		if got, err := s.Empty(); err != nil || got != want {
			t.Fatalf("Empty() = %v, %v; want %v", got, err, want)
		}
	}
	s := newStore(t)
	check(s, true)
	if _, err := s.PutBytes([]byte("in place")); err != nil {
		t.Fatal(err)
	}
	check(s, false)

	s = newStore(t)
	release := holdLatePublication(t)
	j, err := s.BeginJournal()
	if err != nil {
		t.Fatal(err)
	}
	obj := []byte("in this process's journal")
	if err := j.PutBytesExpect(obj, Sum(obj)); err != nil {
		t.Fatal(err)
	}
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
	check(s, false)
	release()
	s.Settle()
	check(s, false)

	s = newStore(t)
	writeDeadJournal(t, s, [][]byte{[]byte("in a dead writer's journal")}, nil)
	check(s, false)
}

// TestJournalWriterPutAllCompressed: objects given compressed are decoded and checked
// before they are journaled, kept compressed in the journal, and read back whole
// (from the journal before they are under their names, then in place); one that
// decodes to other bytes, does not decode, or claims another size is refused.
func TestJournalWriterPutAllCompressed(t *testing.T) {
	s := newStore(t)
	release := holdLatePublication(t)
	j, err := s.BeginJournal()
	if err != nil {
		t.Fatal(err)
	}
	var good [][]byte
	var objs []Object
	for i := 0; i < 20; i++ {
		data := bytes.Repeat([]byte(fmt.Sprintf("compressible object %d\n", i)), 200+i)
		good = append(good, data)
		objs = append(objs, Object{Hash: Sum(data), Data: CompressObject(nil, data), Compressed: true, Size: int64(len(data))})
	}
	stored := int64(0)
	for _, o := range objs {
		stored += int64(len(o.Data))
	}
	other := bytes.Repeat([]byte("other\n"), 100)
	garbage := CompressObject(nil, other)
	garbage = append(garbage[:len(garbage)/2:len(garbage)/2], bytes.Repeat([]byte{0xff}, len(garbage))...)
	bad := []Object{
		{Hash: Sum([]byte("claimed")), Data: CompressObject(nil, other), Compressed: true, Size: int64(len(other))},
		{Hash: Sum(other), Data: garbage, Compressed: true, Size: int64(len(other))},
		{Hash: Sum(other), Data: CompressObject(nil, other), Compressed: true, Size: int64(len(other)) - 1},
	}
	refused, err := j.PutAllExpect(append(objs, bad...))
	if err != nil {
		t.Fatal(err)
	}
	if len(refused) != len(bad) {
		t.Fatalf("refused %v, want the %d bad objects", refused, len(bad))
	}
	path := j.f.Name()
	if err := j.Commit(); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Size() != int64(len(journalMagic)+journalEntryHeader*len(good))+stored {
		t.Fatalf("journal: %v, %v; want the good objects, compressed", st, err)
	}
	for _, g := range good[:len(good)/2] { // the rest is written under its name by the publication
		if got, err := s.ReadAll(Sum(g), 1<<20); err != nil || !bytes.Equal(got, g) {
			t.Fatalf("ReadAll before publication: %d bytes, %v", len(got), err)
		}
	}
	release()
	s.Settle()
	for _, g := range good {
		if err := s.Verify(Sum(g)); err != nil {
			t.Fatal(err)
		}
	}
	if ok, _ := s.Has(Sum(other)); ok {
		t.Fatal("a refused object was stored")
	}
}

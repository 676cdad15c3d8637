package casstore

import (
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
)

// holdLatePublication stops background publications before they write anything until
// the returned release is called.
func holdLatePublication(t *testing.T) (release func()) {
	t.Helper()
	gate := make(chan struct{})
	publishLateHook = func() { <-gate }
	var released bool
	release = func() {
		if !released {
			released = true
			close(gate)
		}
	}
	t.Cleanup(func() {
		release()
		publishLateHook = nil
	})
	return release
}

// commitJournaled commits n buffered objects (a journaled batch) and returns them.
func commitJournaled(t *testing.T, s *Store, n int, tag string) map[Hash][]byte {
	t.Helper()
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Buffer(1 << 20)
	objects := map[Hash][]byte{}
	for i := 0; i < n; i++ {
		data := []byte(fmt.Sprintf("%s object %03d", tag, i))
		h, err := b.PutBytes(data)
		if err != nil {
			t.Fatal(err)
		}
		objects[h] = data
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	return objects
}

// TestLateObjectsReadable: a journaled batch returns before its objects are under
// their names, and every reader still finds them: the same store from memory,
// another store on the same root (another process) from the journal. Each read puts
// the object in place; the background publication and the settling then finish
// without error, and nothing is lost.
func TestLateObjectsReadable(t *testing.T) {
	s := newStore(t)
	release := holdLatePublication(t)
	objects := commitJournaled(t, s, 12, "late")
	var hs []Hash
	for h := range objects {
		hs = append(hs, h)
		if _, err := os.Lstat(s.Path(h)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("object %s is under its name before its publication ran: %v", h, err)
		}
	}
	other, err := Open(s.Root())
	if err != nil {
		t.Fatal(err)
	}
	// Each reader on its own object, half in this store and half in the other.
	for i, h := range hs {
		want := objects[h]
		st := s
		if i%2 == 1 {
			st = other
		}
		switch i % 6 {
		case 0, 1:
			got, err := st.ReadAll(h, 1<<20)
			if err != nil || string(got) != string(want) {
				t.Fatalf("ReadAll %s (store %d): %q %v", h, i%2, got, err)
			}
		case 2, 3:
			f, err := st.Open(h)
			if err != nil {
				t.Fatalf("Open %s (store %d): %v", h, i%2, err)
			}
			got, _ := io.ReadAll(f)
			f.Close()
			if string(got) != string(want) {
				t.Fatalf("Open %s (store %d) read %q", h, i%2, got)
			}
		default:
			if n, err := st.Size(h); err != nil || n != int64(len(want)) {
				t.Fatalf("Size %s (store %d): %d %v", h, i%2, n, err)
			}
			if ok, err := st.Has(h); err != nil || !ok {
				t.Fatalf("Has %s (store %d): %v %v", h, i%2, ok, err)
			}
		}
		if _, err := os.Lstat(s.Path(h)); err != nil {
			t.Fatalf("object %s not in place after it was read: %v", h, err)
		}
	}
	// A missing object stays missing, with the usual error.
	absent := Sum([]byte("never stored"))
	if ok, err := other.Has(absent); err != nil || ok {
		t.Fatalf("Has of an absent object: %v %v", ok, err)
	}
	if _, err := other.ReadAll(absent, 1<<20); err == nil {
		t.Fatal("ReadAll of an absent object succeeded")
	}
	release()
	s.Settle()
	if js, err := s.Journals(); err != nil || len(js) != 0 {
		t.Fatalf("journals after settling: %v %v", js, err)
	}
	for h, want := range objects {
		if err := s.Verify(h); err != nil {
			t.Fatalf("object %s after publication: %v", h, err)
		}
		got, _ := os.ReadFile(s.Path(h))
		if string(got) != string(want) {
			t.Fatalf("object %s holds %q", h, got)
		}
	}
	if tf, err := s.TempFiles(); err != nil || len(tf) != 0 {
		t.Fatalf("temp files left: %v %v", tf, err)
	}
}

// TestLatePublicationHoldsGCLock: the GC lock a journaled batch held is released only
// when both its caller and its background publication are done, so no collection runs
// while its objects are not yet under their names.
func TestLatePublicationHoldsGCLock(t *testing.T) {
	s := newStore(t)
	release := holdLatePublication(t)
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	b.Buffer(1 << 20)
	if _, err := b.PutBytes([]byte("held")); err != nil {
		t.Fatal(err)
	}
	done, err := b.Publish()
	if err != nil {
		t.Fatal(err)
	}
	done()
	done() // a second call changes nothing
	locked := make(chan struct{})
	go func() {
		unlock, err := s.LockExclusive()
		if err == nil {
			unlock()
		}
		close(locked)
	}()
	select {
	case <-locked:
		t.Fatal("the GC lock was free while a publication was still running")
	default:
	}
	release()
	<-locked
	s.Settle()
}

// TestLateObjectCorruptJournal: a journal entry that does not hash to its name is
// never written under that name; the reader gets an error naming the object, as for
// a missing object.
func TestLateObjectCorruptJournal(t *testing.T) {
	s := newStore(t)
	good := []byte("good bytes")
	p := writeDeadJournal(t, s, [][]byte{good}, nil)
	raw, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)-1] ^= 0xff
	if err := os.WriteFile(p, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	h := Sum(good)
	if _, err := s.ReadAll(h, 1<<20); err == nil {
		t.Fatal("ReadAll of an object whose journal entry is corrupt succeeded")
	}
	if _, err := os.Lstat(s.Path(h)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("corrupt journal entry written under its name: %v", err)
	}
}

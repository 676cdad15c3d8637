package casstore

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

func newStore(t *testing.T) *Store {
	t.Helper()
	s, err := Open(filepath.Join(t.TempDir(), "cas"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Settle) // journaled batches settle before the temp dir goes
	return s
}

func countObjects(t *testing.T, s *Store) int {
	t.Helper()
	n := 0
	if err := s.Walk(func(Hash, string) error { n++; return nil }); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestPutLayoutAndRead(t *testing.T) {
	s := newStore(t)
	data := []byte("hello")
	h, err := s.PutBytes(data)
	if err != nil {
		t.Fatal(err)
	}
	if h != Sum(data) {
		t.Fatalf("hash %s", h)
	}
	x := h.String()
	if _, err := os.Stat(filepath.Join(s.Root(), x[:2], x[2:])); err != nil {
		t.Fatalf("not in LunarFS layout: %v", err)
	}
	f, err := s.Open(h)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, 10)
	n, _ := f.Read(got)
	if string(got[:n]) != "hello" {
		t.Fatalf("read %q", got[:n])
	}
	if size, err := s.Size(h); err != nil || size != 5 {
		t.Fatalf("size %d %v", size, err)
	}
	big := bytes.Repeat([]byte("0123456789"), 300_000) // streamed, above smallFile
	hb, err := s.Put(bytes.NewReader(big))
	if err != nil || hb != Sum(big) {
		t.Fatalf("stream put %s %v", hb, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Root(), tmpDirName)); len(ents) != 0 {
		t.Fatalf("temp files left: %v", ents)
	}
}

func TestMissingAndCorruptObjects(t *testing.T) {
	s := newStore(t)
	if _, err := s.Open(Sum([]byte("absent"))); !errdefs.IsNotFound(err) {
		t.Fatalf("missing object: %v", err)
	}
	h, _ := s.PutBytes([]byte("original content"))
	if err := os.WriteFile(s.Path(h), []byte("tampered content"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := s.Open(h)
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Hash != h || !errdefs.IsDataLoss(err) || !strings.Contains(err.Error(), h.String()) {
		t.Fatalf("corrupt object: %v", err)
	}
	if _, err := s.ReadAll(h, 1<<20); !errors.As(err, &ce) {
		t.Fatalf("ReadAll of corrupt object: %v", err)
	}
	if err := s.Verify(h); !errors.As(err, &ce) {
		t.Fatalf("Verify of corrupt object: %v", err)
	}
}

// A verification is tied to the file version it checked: rewriting the object file
// after a good open is caught on the next open.
func TestVerificationFollowsFileVersion(t *testing.T) {
	s := newStore(t)
	h, _ := s.PutBytes([]byte("good bytes"))
	f, err := s.Open(h)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	tmp := s.Path(h) + ".x"
	os.WriteFile(tmp, []byte("evil bytes"), 0o644)
	os.Rename(tmp, s.Path(h))
	if _, err := s.Open(h); !errdefs.IsDataLoss(err) {
		t.Fatalf("replaced object served: %v", err)
	}
}

func TestAbortedBatchLeavesStoreUnchanged(t *testing.T) {
	s := newStore(t)
	s.PutBytes([]byte("existing"))
	before := countObjects(t, s)
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if _, err := b.PutBytes([]byte{byte(i), 1, 2}); err != nil {
			t.Fatal(err)
		}
	}
	b.Abort()
	if after := countObjects(t, s); after != before {
		t.Fatalf("objects %d -> %d after abort", before, after)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Root(), tmpDirName)); len(ents) != 0 {
		t.Fatalf("temp files left: %d", len(ents))
	}
}

func TestConcurrentWritersOfOneObject(t *testing.T) {
	s := newStore(t)
	data := bytes.Repeat([]byte("same"), 500_000)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h, err := s.Put(bytes.NewReader(data))
			if err == nil && h != Sum(data) {
				err = errors.New("wrong hash")
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Verify(Sum(data)); err != nil {
		t.Fatal(err)
	}
	if n := countObjects(t, s); n != 1 {
		t.Fatalf("%d objects", n)
	}
}

func TestSweepTemp(t *testing.T) {
	s := newStore(t)
	old := filepath.Join(s.Root(), tmpDirName, "obj-old")
	young := filepath.Join(s.Root(), tmpDirName, "obj-young")
	os.MkdirAll(filepath.Join(s.Root(), "ab"), 0o755)
	lunarTmp := filepath.Join(s.Root(), "ab", strings.Repeat("c", 62)+".tmp")
	for _, p := range []string{old, young, lunarTmp} {
		os.WriteFile(p, []byte("x"), 0o644)
	}
	past := time.Now().Add(-2 * time.Hour)
	os.Chtimes(old, past, past)
	os.Chtimes(lunarTmp, past, past)
	n, err := s.SweepTemp(time.Hour)
	if err != nil || n != 2 {
		t.Fatalf("swept %d, %v", n, err)
	}
	if _, err := os.Stat(young); err != nil {
		t.Fatal("a young temp file was swept")
	}
}

func TestCommitRefreshesMtime(t *testing.T) {
	s := newStore(t)
	b, _ := s.Begin()
	h, _ := b.PutBytes([]byte("staged long ago"))
	b.mu.Lock()
	tmp := b.pending[h]
	b.mu.Unlock()
	past := time.Now().Add(-48 * time.Hour)
	os.Chtimes(tmp, past, past)
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(s.Path(h))
	if err != nil || time.Since(st.ModTime()) > time.Minute {
		t.Fatalf("published object has an old mtime: %v %v", st.ModTime(), err)
	}
}

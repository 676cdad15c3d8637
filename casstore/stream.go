package casstore

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// A JournalWriter is the journal (journal.go) fed as a stream, for writers that
// receive many objects at once from elsewhere (a pull of a remote's pack): writing
// 12k objects as one file each and syncing them costs seconds on a virtual disk,
// while appending them to one file and syncing it once costs what writing their
// bytes costs. Entries are appended as they arrive, each verified against its name
// before it is (a big one, streamed, is appended under the zero name and named once
// its bytes hashed right, so no entry ever claims a name its bytes do not have);
// writeback of the journal starts while the writer is still receiving; Commit syncs
// it once and returns: the objects are then durable (replay) and readable through
// the store (Materialize finds them by their offsets in the journal; nothing is held
// in memory), and they are written under their names in the background, holding the
// GC lock shared until they are, then settled like a journaled batch.
//
// A writer killed before Commit leaves a journal whose owner is dead: replay writes
// every whole, verified entry under its name and ignores the torn tail, so the work
// is kept and a re-run of the pull fetches only the rest.
type JournalWriter struct {
	s    *Store
	lock *os.File

	mu      sync.Mutex
	f       *os.File
	w       *bufio.Writer
	off     int64 // end of what is written, buffered bytes included
	started int64 // writeback started up to here
	entries map[Hash]journalEntry
	order   []Hash
	err     error // a write failed: the journal is unusable
	done    bool
}

// writebackEvery is how many written bytes make the journal start writing back
// (sync_file_range), so that Commit's sync finds little left to write.
const writebackEvery = 8 << 20

// BeginJournal starts a journal writer. It holds the GC lock shared, as a batch does,
// from now until its objects are under their names (or Abort).
func (s *Store) BeginJournal() (*JournalWriter, error) {
	lf, err := s.lock(unix.LOCK_SH)
	if err != nil {
		return nil, err
	}
	s.sweepDeadOnce()
	f, err := s.createJournal()
	if err != nil {
		lf.Close()
		return nil, err
	}
	j := &JournalWriter{s: s, lock: lf, f: f, w: bufio.NewWriterSize(f, 1<<20), entries: map[Hash]journalEntry{}}
	j.w.WriteString(journalMagic)
	j.off = int64(len(journalMagic))
	return j, nil
}

// createJournal creates a new journal file, named for this process.
func (s *Store) createJournal() (*os.File, error) {
	dir := s.journalDir()
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("create journal directory: %w", err)
	}
	f, err := os.CreateTemp(dir, "jnl-"+tempPrefix()[len("obj-"):]+"*")
	if err != nil {
		return nil, fmt.Errorf("create journal: %w", err)
	}
	return f, nil
}

// Holds reports whether the journal already holds h.
func (j *JournalWriter) Holds(h Hash) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	_, ok := j.entries[h]
	return ok
}

// Len is the number of objects in the journal.
func (j *JournalWriter) Len() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.entries)
}

// PutBytesExpect appends data to the journal after checking that it hashes to want
// (a *CorruptError if not: nothing is written).
func (j *JournalWriter) PutBytesExpect(data []byte, want Hash) error {
	if got := Sum(data); got != want {
		return &CorruptError{Hash: want, Got: got, Path: "transfer"}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if err := j.usable(); err != nil {
		return err
	}
	if _, dup := j.entries[want]; dup {
		return nil
	}
	var hdr [HashSize + 8]byte
	copy(hdr[:], want[:])
	binary.BigEndian.PutUint64(hdr[HashSize:], uint64(len(data)))
	j.w.Write(hdr[:])
	if _, err := j.w.Write(data); err != nil {
		return j.fail(err)
	}
	j.add(want, j.off+int64(len(hdr)), int64(len(data)))
	return nil
}

// PutExpect streams an object of n bytes from r into the journal, hashing it as it
// is written; if it does not hash to want (a *CorruptError), or r ends early, the
// entry is cut off the journal again. Other writers wait meanwhile.
func (j *JournalWriter) PutExpect(r io.Reader, want Hash, n int64) (int64, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if err := j.usable(); err != nil {
		return 0, err
	}
	if err := j.w.Flush(); err != nil {
		return 0, j.fail(err)
	}
	start := j.off
	// Written under the zero name, which no bytes hash to: until its name is written
	// below, a replay or an index of this journal stops at this entry.
	var hdr [HashSize + 8]byte
	binary.BigEndian.PutUint64(hdr[HashSize:], uint64(n))
	if _, err := j.f.WriteAt(hdr[:], start); err != nil {
		return 0, j.fail(err)
	}
	dst := &writeErr{w: io.NewOffsetWriter(j.f, start+int64(len(hdr)))}
	got, read, err := copyHashing(dst, io.LimitReader(r, n))
	cut := func(err error) (int64, error) {
		if terr := j.f.Truncate(start); terr != nil {
			return read, j.fail(errors.Join(err, terr))
		}
		return read, err
	}
	switch {
	case dst.err != nil:
		return cut(j.fail(dst.err))
	case err != nil:
		return cut(fmt.Errorf("read object %s: %w", want, err))
	case read < n:
		return cut(fmt.Errorf("read object %s: %w after %d of %d bytes", want, io.ErrUnexpectedEOF, read, n))
	case got != want:
		return cut(&CorruptError{Hash: want, Got: got, Path: "transfer"})
	}
	if _, dup := j.entries[want]; dup {
		return cut(nil)
	}
	if _, err := j.f.WriteAt(want[:], start); err != nil {
		return read, j.fail(err)
	}
	end := start + int64(len(hdr)) + n
	if _, err := j.f.Seek(end, io.SeekStart); err != nil {
		return read, j.fail(err)
	}
	j.add(want, start+int64(len(hdr)), n)
	return read, nil
}

// add records an entry whose n bytes were just written at off, the end of the
// journal, and starts writeback when enough was written since it last did.
func (j *JournalWriter) add(h Hash, off, n int64) {
	j.entries[h] = journalEntry{path: j.f.Name(), off: off, size: n}
	j.order = append(j.order, h)
	j.off = off + n
	if flushed := j.off - int64(j.w.Buffered()); flushed-j.started >= writebackEvery {
		// Best effort: the sync in Commit is what makes the journal durable.
		_ = unix.SyncFileRange(int(j.f.Fd()), j.started, flushed-j.started, unix.SYNC_FILE_RANGE_WRITE)
		j.started = flushed
	}
}

func (j *JournalWriter) usable() error {
	if j.done {
		return errors.New("journal already finished")
	}
	return j.err
}

func (j *JournalWriter) fail(err error) error {
	if j.err == nil {
		j.err = fmt.Errorf("write journal %s: %w", j.f.Name(), err)
	}
	return j.err
}

// Commit makes the journal durable (one sync of it and of its directory) and returns;
// its objects are readable through the store from then on and are written under
// their names in the background (see above; WaitPublished waits for that, Settle for
// their settling too). A journal without objects is removed. On error nothing was
// committed and the journal is gone.
func (j *JournalWriter) Commit() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.done {
		return errors.New("journal already finished")
	}
	j.done = true
	path := j.f.Name()
	fail := func(err error) error {
		j.f.Close()
		os.Remove(path)
		j.lock.Close()
		return err
	}
	if j.err != nil {
		return fail(j.err)
	}
	if len(j.entries) == 0 {
		return fail(nil)
	}
	if err := j.w.Flush(); err != nil {
		return fail(fmt.Errorf("write journal %s: %w", path, err))
	}
	if err := j.f.Sync(); err != nil {
		return fail(fmt.Errorf("sync journal %s: %w", path, err))
	}
	if err := j.f.Close(); err != nil {
		return fail(fmt.Errorf("write journal %s: %w", path, err))
	}
	if err := fsyncPath(j.s.journalDir()); err != nil {
		return fail(fmt.Errorf("sync journal directory: %w", err))
	}
	j.s.journalsChanged()
	j.s.addLateEntries(j.entries)
	j.s.late.running.Add(1)
	go j.publish(path, j.entries, j.order)
	return nil
}

// Abort removes the journal and releases the GC lock; a no-op after Commit.
func (j *JournalWriter) Abort() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.done {
		return
	}
	j.done = true
	j.f.Close()
	os.Remove(j.f.Name())
	j.lock.Close()
}

// publishWorkers is how many objects a committed journal writes under their names at
// once: the time goes into file creations, which several writers overlap.
func publishWorkers() int { return max(4, 2*runtime.GOMAXPROCS(0)) }

// publish writes a committed journal's objects under their names (those not there
// yet), then queues the journal for settling and releases the GC lock. If an object
// cannot be written, the journal stays (its objects readable from it, and replayed
// once this process is gone).
func (j *JournalWriter) publish(path string, entries map[Hash]journalEntry, order []Hash) {
	defer j.s.late.running.Done()
	defer j.lock.Close()
	if publishLateHook != nil {
		publishLateHook()
	}
	var (
		next   atomic.Int64
		failed atomic.Pointer[error]
		wg     sync.WaitGroup
	)
	for w := 0; w < publishWorkers(); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(order)) || failed.Load() != nil {
					return
				}
				h := order[i]
				if _, err := os.Lstat(j.s.Path(h)); err == nil {
					continue
				}
				if err := j.s.placeFromJournal(h, entries[h]); err != nil {
					failed.CompareAndSwap(nil, &err)
				}
			}
		}()
	}
	wg.Wait()
	if err := failed.Load(); err != nil {
		log.L.WithError(*err).WithField("journal", path).Error("store: writing a journal's objects under their names failed; they stay in the journal")
		return
	}
	objects := make([]string, 0, len(order))
	published := make([]SizeEntry, 0, len(order))
	for _, h := range order {
		objects = append(objects, j.s.Path(h))
		published = append(published, SizeEntry{Hash: h, Size: entries[h].size})
	}
	j.s.dropLateEntries(order)
	j.s.queueSettle(journaled{journal: path, objects: objects, published: published})
}

// placeFromJournal writes the object a journal holds at e under its name, without
// syncing it (the journal keeps it durable until it is settled), streaming it and
// checking its bytes against its name on the way.
func (s *Store) placeFromJournal(h Hash, e journalEntry) error {
	f, err := os.Open(e.path)
	if err != nil {
		return err
	}
	defer f.Close()
	return s.writeObject(h, io.NewSectionReader(f, e.off, e.size), false)
}

// writeObject writes the bytes of r, which must hash to h, under h's name (temp file,
// rename), durably if sync.
func (s *Store) writeObject(h Hash, r io.Reader, sync bool) error {
	f, err := os.CreateTemp(s.tmp, tempPrefix()+"*")
	if err != nil {
		return fmt.Errorf("write object %s: %w", h, err)
	}
	tmp := f.Name()
	got, _, err := copyHashing(f, r)
	if err == nil && got != h {
		err = &CorruptError{Hash: h, Got: got, Path: tmp}
	}
	if err == nil && sync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && s.objPerm != 0o600 {
		err = os.Chmod(tmp, s.objPerm)
	}
	if err == nil {
		err = s.adopt(tmp)
	}
	if err == nil {
		err = s.ensureFanout(filepath.Dir(s.Path(h)))
	}
	if err == nil {
		err = os.Rename(tmp, s.Path(h))
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write object %s: %w", h, err)
	}
	return nil
}

// writeErr remembers its writer's failure, to tell it from its reader's in a copy.
type writeErr struct {
	w   io.Writer
	err error
}

func (w *writeErr) Write(b []byte) (int, error) {
	n, err := w.w.Write(b)
	if err != nil && w.err == nil {
		w.err = err
	}
	return n, err
}

package casstore

import (
	"bufio"
	"bytes"
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
// bytes costs. Entries are appended as they arrive, one by one or in batches
// (PutAllExpect: vectored writes of many objects, given raw or as compressed blocks
// that the journal keeps as they are), each verified against its name before it is
// (a big one, streamed, is appended under the zero name and named once its bytes
// hashed right, so no entry ever claims a name its bytes do not have); writeback
// and background syncs of the journal run while the writer is still receiving;
// Commit syncs it a last time and returns: the objects are then durable (replay) and
// readable through
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
	syncer  *journalSyncer // started once writeback is
}

// writebackEvery is how many written bytes make the journal start writing back
// (sync_file_range) and sync in the background, so that Commit's sync finds little
// left to write or flush: on a virtual disk with a write-back cache a sync flushes
// all that was written since the last one, and a single sync of a pull's 50 MB
// journal at its end took 50-100 ms where the background syncs leave a few.
const writebackEvery = 8 << 20

// journalSyncer syncs a journal in the background each time it is nudged (nudges
// while it syncs are merged). The sync in Commit is what makes the journal durable;
// a background sync's failure fails the Commit too, since a later sync may not
// report it again.
type journalSyncer struct {
	nudge chan struct{}
	done  chan struct{}
	err   error // read after done
}

func startJournalSyncer(f *os.File) *journalSyncer {
	js := &journalSyncer{nudge: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(js.done)
		rc, err := f.SyscallConn()
		if err != nil {
			js.err = err
			return
		}
		for range js.nudge {
			var serr error
			if err := rc.Control(func(fd uintptr) { serr = unix.Fdatasync(int(fd)) }); err != nil {
				serr = err
			}
			if serr != nil && js.err == nil {
				js.err = serr
			}
		}
	}()
	return js
}

func (js *journalSyncer) poke() {
	select {
	case js.nudge <- struct{}{}:
	default:
	}
}

// stop waits for the syncer to finish and returns its first failure.
func (js *journalSyncer) stop() error {
	if js == nil {
		return nil
	}
	close(js.nudge)
	<-js.done
	return js.err
}

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
	var buf [journalEntryHeader]byte
	hdr := appendEntryHeader(buf[:0], want, int64(len(data)), int64(len(data)))
	j.w.Write(hdr)
	if _, err := j.w.Write(data); err != nil {
		return j.fail(err)
	}
	j.add(want, j.off+int64(len(hdr)), int64(len(data)), int64(len(data)))
	return nil
}

// Object is an object's name and its bytes: the object itself or, if Compressed,
// one LZ4 block of it (see CompressObject), which the journal then holds as it is.
type Object struct {
	Hash       Hash
	Data       []byte
	Compressed bool
	// Size is the object's size; for a compressed object it must be given (and be
	// at most 64 MiB: it is decoded in memory), otherwise it is len(Data).
	Size int64
}

// PutAllExpect appends the objects of objs whose bytes hash to their names (a
// compressed object is decoded to be hashed). They are checked first, in the
// caller's goroutine and without the journal's lock (callers appending from several
// goroutines hash in parallel); then the good ones are appended with vectored
// writes of their headers and bytes as they lie in memory: a few system calls and no
// copy for many small objects. Objects whose bytes do not hash to their names, or do
// not decode to their size, are returned as refused, and nothing of them is
// written. err is a failure of the journal, after which nothing more can be appended.
func (j *JournalWriter) PutAllExpect(objs []Object) (refused []*CorruptError, err error) {
	ok := make([]bool, len(objs))
	scratch := getDecodeBuf()
	defer decodeBufs.Put(scratch)
	for i, o := range objs {
		data := o.Data
		if o.Compressed {
			if o.Size > maxCompressedObject {
				return refused, fmt.Errorf("object %s: %d bytes is too large to be journaled compressed", o.Hash, o.Size)
			}
			d, err := decodeObject(*scratch, o.Data, o.Size)
			if err != nil {
				refused = append(refused, &CorruptError{Hash: o.Hash, Path: "transfer", Reason: err.Error()})
				continue
			}
			*scratch, data = d, d
		}
		if got := Sum(data); got != o.Hash {
			refused = append(refused, &CorruptError{Hash: o.Hash, Got: got, Path: "transfer"})
			continue
		}
		ok[i] = true
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if err := j.usable(); err != nil {
		return refused, err
	}
	if err := j.w.Flush(); err != nil {
		return refused, j.fail(err)
	}
	hdrs := make([]byte, 0, journalEntryHeader*len(objs))
	iovs := make([][]byte, 0, 2*len(objs))
	for i, o := range objs {
		if _, dup := j.entries[o.Hash]; !ok[i] || dup {
			continue
		}
		size := int64(len(o.Data))
		if o.Compressed {
			size = o.Size
		}
		at := len(hdrs)
		hdrs = appendEntryHeader(hdrs, o.Hash, size, int64(len(o.Data)))
		iovs = append(iovs, hdrs[at:len(hdrs)], o.Data)
		// Recorded before the write: if it fails, the journal is unusable and Commit
		// removes it.
		j.record(o.Hash, j.off+journalEntryHeader, size, int64(len(o.Data)))
	}
	if err := writevAll(j.f, iovs); err != nil {
		return refused, j.fail(err)
	}
	j.writeback()
	return refused, nil
}

// writevAll writes every byte of iovs at f's offset, IOV_MAX slices a call.
func writevAll(f *os.File, iovs [][]byte) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	const iovMax = 1024
	for {
		for len(iovs) > 0 && len(iovs[0]) == 0 {
			iovs = iovs[1:]
		}
		if len(iovs) == 0 {
			return nil
		}
		var n int
		var werr error
		if err := rc.Write(func(fd uintptr) bool {
			n, werr = unix.Writev(int(fd), iovs[:min(len(iovs), iovMax)])
			return werr != unix.EAGAIN
		}); err != nil {
			return err
		}
		switch {
		case werr == unix.EINTR:
			continue
		case werr != nil:
			return werr
		case n == 0:
			return io.ErrShortWrite
		}
		for n > 0 {
			if n < len(iovs[0]) {
				iovs[0] = iovs[0][n:]
				break
			}
			n -= len(iovs[0])
			iovs = iovs[1:]
		}
	}
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
	var buf [journalEntryHeader]byte
	hdr := appendEntryHeader(buf[:0], Hash{}, n, n)
	if _, err := j.f.WriteAt(hdr, start); err != nil {
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
	j.add(want, start+int64(len(hdr)), n, n)
	return read, nil
}

// add records an entry whose n bytes were just written at off, the end of the
// journal, and starts writeback when enough was written since it last did.
func (j *JournalWriter) add(h Hash, off, size, stored int64) {
	j.record(h, off, size, stored)
	j.writeback()
}

// record notes an entry of an object of size bytes whose stored bytes are at off,
// the end of the journal.
func (j *JournalWriter) record(h Hash, off, size, stored int64) {
	j.entries[h] = journalEntry{path: j.f.Name(), off: off, size: size, stored: stored}
	j.order = append(j.order, h)
	j.off = off + stored
}

// writeback starts writing back what was written since it last did, once that is
// writebackEvery bytes.
func (j *JournalWriter) writeback() {
	if flushed := j.off - int64(j.w.Buffered()); flushed-j.started >= writebackEvery {
		// Best effort: the sync in Commit is what makes the journal durable.
		_ = unix.SyncFileRange(int(j.f.Fd()), j.started, flushed-j.started, unix.SYNC_FILE_RANGE_WRITE)
		j.started = flushed
		if j.syncer == nil {
			j.syncer = startJournalSyncer(j.f)
		}
		j.syncer.poke()
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
	serr := j.syncer.stop()
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
	if serr != nil {
		return fail(fmt.Errorf("sync journal %s: %w", path, serr))
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
	j.syncer.stop()
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
	if !e.compressed() {
		return s.writeObject(h, io.NewSectionReader(f, e.off, e.size), false)
	}
	blockBuf, scratch := getDecodeBuf(), getDecodeBuf()
	defer decodeBufs.Put(blockBuf)
	defer decodeBufs.Put(scratch)
	if int64(cap(*blockBuf)) < e.stored {
		*blockBuf = make([]byte, e.stored)
	}
	block := (*blockBuf)[:e.stored]
	if _, err := f.ReadAt(block, e.off); err != nil {
		return fmt.Errorf("read object %s from journal %s: %w", h, e.path, err)
	}
	data, err := decodeObject(*scratch, block, e.size)
	if err != nil {
		return &CorruptError{Hash: h, Path: e.path, Reason: err.Error()}
	}
	*scratch = data
	return s.writeObject(h, bytes.NewReader(data), false)
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

package casstore

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// A buffered batch (see Batch.Buffer: a container being branched, whose caller waits)
// makes its new objects durable with one fsync instead of one per object and one per
// fan-out directory: before publishing, it writes every new object into one journal
// file, STORE/.tidepool-tmp/journal/jnl-PID.START-RANDOM, and syncs that file and its
// directory. Then the caller records what names them while the objects are published
// in the background (temp file, rename) without syncing (late.go), and later (see
// settler) one syncfs makes them durable in place, their sizes go to the size index
// and the journal is removed.
//
// A journal whose writer no longer runs (its name says who, as for temp files) is
// replayed by the next batch in any process and by tidepoold's start (SweepDeadTemp):
// every entry that hashes to its name is written again, durably, where the object is
// missing or does not hash to its name; objects already right are synced; then the
// journal goes. A journal is its magic, "TPJRNL2\n", then entries: the object's
// 32-byte hash, its 8-byte size, the 8-byte length of what follows, then the object's
// bytes (that length equals the size) or, shorter, one LZ4 block of them (an object a
// pull received compressed, compress.go); integers are big-endian. A journal an
// earlier version wrote, "TPJRNL1\n", has entries of hash, size and bytes. A torn
// tail (a crash while the journal was written, before anything named its objects)
// ends the replay of that journal. So after a crash at any point every object a record
// names is whole once a writer or tidepoold has started, and nothing is half-written
// under an object's name.

const (
	journalDirName = "journal"
	journalMagic   = "TPJRNL2\n"
	journalMagicV1 = "TPJRNL1\n"
	// journalEntryHeader is the size of an entry's header: hash, size, stored length.
	journalEntryHeader = HashSize + 8 + 8
	// maxCompressedObject bounds the size of an object a journal holds compressed
	// (it is decoded in memory); a bigger one is stored raw.
	maxCompressedObject = 64 << 20
)

// appendEntryHeader appends an entry's header: h, the object's size, and the length
// of the stored bytes that follow.
func appendEntryHeader(b []byte, h Hash, size, stored int64) []byte {
	b = append(b, h[:]...)
	b = binary.BigEndian.AppendUint64(b, uint64(size))
	return binary.BigEndian.AppendUint64(b, uint64(stored))
}

// journalReader reads a journal's entries in order.
type journalReader struct {
	r   *bufio.Reader
	v1  bool
	off int64 // of the next entry
}

// newJournalReader reads a journal's magic; ok is false for a file torn before its
// first entry, or not a journal.
func newJournalReader(f io.Reader, bufSize int) (*journalReader, bool) {
	r := bufio.NewReaderSize(f, bufSize)
	magic := make([]byte, len(journalMagic))
	if _, err := io.ReadFull(r, magic); err != nil {
		return nil, false
	}
	switch string(magic) {
	case journalMagic:
		return &journalReader{r: r, off: int64(len(magic))}, true
	case journalMagicV1:
		return &journalReader{r: r, v1: true, off: int64(len(magic))}, true
	}
	return nil, false
}

// next reads the next entry's header: where the entry's stored bytes begin (the
// reader is there), its name, the object's size and the stored length. ok is false at
// the end or at a header that cannot be whole (a torn tail).
func (jr *journalReader) next() (e journalEntry, h Hash, ok bool) {
	n := journalEntryHeader
	if jr.v1 {
		n = HashSize + 8
	}
	var hdr [journalEntryHeader]byte
	if _, err := io.ReadFull(jr.r, hdr[:n]); err != nil {
		return e, h, false
	}
	copy(h[:], hdr[:HashSize])
	size := binary.BigEndian.Uint64(hdr[HashSize:])
	stored := size
	if !jr.v1 {
		stored = binary.BigEndian.Uint64(hdr[HashSize+8:])
	}
	if size > 1<<40 || stored > size || stored < size && size > maxCompressedObject {
		return e, h, false
	}
	e = journalEntry{off: jr.off + int64(n), size: int64(size), stored: int64(stored)}
	jr.off = e.off + e.stored
	return e, h, true
}

// skip passes over the stored bytes of the entry next returned.
func (jr *journalReader) skip(e journalEntry) bool {
	d, err := jr.r.Discard(int(e.stored))
	return err == nil && int64(d) == e.stored
}

// object returns a reader of the object of the entry next returned, decoded if it is
// stored compressed.
func (jr *journalReader) object(e journalEntry) (io.Reader, error) {
	if !e.compressed() {
		return io.LimitReader(jr.r, e.size), nil
	}
	block := make([]byte, e.stored)
	if _, err := io.ReadFull(jr.r, block); err != nil {
		return nil, err
	}
	data, err := decodeObject(nil, block, e.size)
	if err != nil {
		return nil, err
	}
	return bytes.NewReader(data), nil
}

// journalDir is where journals live (below the temp directory, whose sweep skips it).
func (s *Store) journalDir() string { return filepath.Join(s.tmp, journalDirName) }

// writeJournal writes objects into a new journal and makes it durable; it returns
// the journal's path.
func (s *Store) writeJournal(objects map[Hash][]byte) (string, error) {
	dir := s.journalDir()
	f, err := s.createJournal()
	if err != nil {
		return "", err
	}
	fail := func(err error) (string, error) {
		f.Close()
		os.Remove(f.Name())
		return "", fmt.Errorf("write journal %s: %w", f.Name(), err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	w.WriteString(journalMagic)
	hdr := make([]byte, 0, journalEntryHeader)
	for h, data := range objects {
		w.Write(appendEntryHeader(hdr, h, int64(len(data)), int64(len(data))))
		w.Write(data)
	}
	if err := w.Flush(); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("write journal %s: %w", f.Name(), err)
	}
	if err := fsyncPath(dir); err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("sync journal directory: %w", err)
	}
	s.journalsChanged()
	return f.Name(), nil
}

// journalsChanged tells readers in every process that a journal is complete: they
// index the journals again when the journal directory's mtime moves (late.go), and a
// journal's creation moved it before its entries were written.
func (s *Store) journalsChanged() {
	now := time.Now()
	_ = os.Chtimes(s.journalDir(), now, now) // best effort: the index is read again on its next change
}

// Settling is deferred, as pool refills are: a journaled batch's objects are
// already durable through its journal, so making them durable in place (and dropping
// the journal) waits until no journaled batch has published for settleQuiet, or
// settleMax after the oldest waiting one, and then settles every waiting batch with
// one syncfs. A burst of branches thus pays one journal sync each, and the host's
// flush comes after the burst rather than inside it.
const (
	settleQuiet = 300 * time.Millisecond
	settleMax   = 3 * time.Second
	// settleBacklog settles at once when this many journals wait.
	settleBacklog = 256
)

// journaled is a published batch whose journal waits to be settled.
type journaled struct {
	journal   string
	objects   []string
	published []SizeEntry
}

// settler defers and groups the settling of journaled batches.
type settler struct {
	mu      sync.Mutex
	waiting []journaled
	since   time.Time // when the oldest waiting batch was queued
	timer   *time.Timer
	running sync.WaitGroup
}

// queueSettle queues a published batch for settling (see above).
func (s *Store) queueSettle(j journaled) {
	st := &s.settle
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.waiting) == 0 {
		st.since = time.Now()
		st.running.Add(1) // one unit for the whole waiting group
	}
	st.waiting = append(st.waiting, j)
	wait := min(settleQuiet, time.Until(st.since.Add(settleMax)))
	if len(st.waiting) >= settleBacklog {
		wait = 0
	}
	if st.timer == nil {
		st.timer = time.AfterFunc(wait, s.settleWaiting)
	} else {
		st.timer.Reset(wait)
	}
}

// settleWaiting settles every waiting batch: under the GC lock (shared), so a
// collection's forgetting of an object's size never comes before this adds it;
// objects collected meanwhile are skipped.
func (s *Store) settleWaiting() {
	st := &s.settle
	st.mu.Lock()
	group := st.waiting
	st.waiting = nil
	st.mu.Unlock()
	if len(group) == 0 {
		return
	}
	defer st.running.Done()
	log := log.L.WithField("store", s.root).WithField("journals", len(group))
	lock, err := s.lock(unix.LOCK_SH)
	if err != nil {
		log.WithError(err).Warn("store: settling journals; they stay for replay")
		return
	}
	defer lock.Close()
	var recorded []SizeEntry
	for _, j := range group {
		for i, p := range j.objects {
			if _, err := os.Lstat(p); err == nil {
				recorded = append(recorded, j.published[i])
			}
		}
	}
	// One syncfs makes every object and directory entry of the group durable.
	if err := s.syncfs(); err != nil {
		log.WithError(err).Warn("store: syncing journaled objects failed; the journals stay for replay")
		return
	}
	_ = s.sizes.add(recorded)
	for _, j := range group {
		if err := os.Remove(j.journal); err != nil && !errors.Is(err, fs.ErrNotExist) {
			log.WithError(err).WithField("journal", j.journal).Warn("store: remove settled journal")
		}
	}
}

// Settle waits for this store's late publications (late.go), settles the journaled
// batches of this process now and waits until they are (tests, and a clean shutdown).
func (s *Store) Settle() {
	s.WaitPublished()
	s.settleWaiting()
	s.settle.running.Wait()
}

// Journals lists the journals in the store and whether their writer still runs.
func (s *Store) Journals() ([]TempFile, error) {
	ents, err := os.ReadDir(s.journalDir())
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("list journals: %w", err)
	}
	var out []TempFile
	for _, e := range ents {
		if e.IsDir() || !strings.HasPrefix(e.Name(), "jnl-") {
			continue
		}
		t := TempFile{Path: filepath.Join(s.journalDir(), e.Name()), Alive: true}
		if info, err := e.Info(); err == nil {
			t.Size = info.Size()
		}
		if pid, start, ok := tempOwner("obj-" + strings.TrimPrefix(e.Name(), "jnl-")); ok {
			t.PID, t.Alive = pid, ownerAlive(pid, start)
		}
		out = append(out, t)
	}
	return out, nil
}

// ReplayDeadJournals replays the journals whose writer no longer runs and returns how
// many objects it wrote again.
func (s *Store) ReplayDeadJournals() (int, error) {
	lock, err := s.lock(unix.LOCK_SH)
	if err != nil {
		return 0, err
	}
	defer lock.Close()
	return s.replayDeadJournals()
}

// replayDeadJournals is ReplayDeadJournals for a caller holding the GC lock shared
// (a batch's Begin).
func (s *Store) replayDeadJournals() (int, error) {
	js, err := s.Journals()
	if err != nil {
		return 0, err
	}
	total := 0
	for _, j := range js {
		if j.Alive {
			continue
		}
		n, err := s.replayJournal(j.Path)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

var replayMu sync.Mutex

// replayJournal restores what one journal holds (see above) and removes it; the
// caller holds the GC lock shared.
func (s *Store) replayJournal(path string) (int, error) {
	replayMu.Lock()
	defer replayMu.Unlock()
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return 0, nil // another process replayed it
		}
		return 0, fmt.Errorf("replay journal: %w", err)
	}
	defer f.Close()
	jr, ok := newJournalReader(f, 1<<20)
	if !ok {
		// Torn before its first entry, or not ours: nothing to restore.
		return 0, s.dropJournal(path)
	}
	rewritten := 0
	for {
		e, h, ok := jr.next()
		if !ok {
			break // the end, or a torn tail
		}
		if ok, _ := s.hashesTo(s.Path(h), h); ok {
			if !jr.skip(e) {
				break
			}
			continue
		}
		// Checked on the way: bytes that do not hash to the entry's name (a torn
		// tail, or an entry a streaming writer had not named yet) or do not decode end
		// the replay, and nothing of them is left under a name.
		r, err := jr.object(e)
		if err != nil {
			break
		}
		err = s.writeObject(h, r, false)
		var ce *CorruptError
		if errors.As(err, &ce) {
			break
		}
		if err != nil {
			return rewritten, fmt.Errorf("replay journal %s: %w", path, err)
		}
		rewritten++
	}
	// One syncfs makes every object the journal holds durable in place, whether this
	// replay or an earlier reader wrote it, with its directory entry.
	if err := s.syncfs(); err != nil {
		return rewritten, fmt.Errorf("replay journal %s: %w", path, err)
	}
	if rewritten > 0 {
		log.L.WithField("journal", path).WithField("objects", rewritten).Warn("store: restored objects from a journal left by a writer that died")
	}
	return rewritten, s.dropJournal(path)
}

func (s *Store) dropJournal(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove replayed journal: %w", err)
	}
	return fsyncPath(s.journalDir())
}

// hashesTo reports whether the file at path holds exactly the bytes named h.
func (s *Store) hashesTo(path string, h Hash) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	got, _, err := copyHashing(io.Discard, f)
	return err == nil && got == h, err
}

// restoreObject writes data (known to hash to h) under its name, durably if sync.
func (s *Store) restoreObject(h Hash, data []byte, sync bool) error {
	return s.writeObject(h, bytes.NewReader(data), sync)
}

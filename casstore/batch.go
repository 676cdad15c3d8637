package casstore

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// smallFile is the size up to which PutFile reads a file into memory once instead of
// streaming it twice (hash, then copy if new).
const smallFile = 1 << 20

// fsyncEach is the number of new objects up to which Commit fsyncs files and
// directories one by one; bigger batches use a single syncfs.
const fsyncEach = 32

// Batch groups object writes so that they land together. New objects are staged as
// temp files and published by Commit; Abort (or a failure before Commit) removes them,
// so a failed ingest or commit leaves the store's set of objects unchanged.
//
// A batch holds the store's GC lock in shared mode from Begin to Commit or Abort, and
// at Commit gives every object it wrote or relies on the same mtime, its publication
// time, so a concurrent garbage collection neither deletes an object the batch is
// about to reference nor keeps a new object while it sweeps one the object names
// (grace is measured from mtimes, and all of one batch's objects are equally young).
type Batch struct {
	s    *Store
	lock *os.File

	mu      sync.Mutex
	pending map[Hash]string   // object -> staged temp file
	sizes   map[Hash]int64    // object -> its length, for the size index
	reused  map[Hash]struct{} // objects already stored that the batch relies on
	done    bool
	// buffered holds objects kept in memory (see Buffer) until they are staged;
	// bufLeft is how many more bytes may be.
	buffered map[Hash][]byte
	bufLeft  int64
	// syncEach is the number of new objects up to which Commit fsyncs them one by
	// one (in parallel) instead of syncing the whole filesystem.
	syncEach int
	// journal is the durable journal of the objects being published, if any.
	journal string
}

// Buffer makes the batch keep new objects in memory, up to limit bytes in all,
// instead of staging each as a temp file at once; they are staged by Flush or at
// Commit. A caller that froze the source it reads (a container being branched)
// lets it go after reading, not after writing every object. Such a caller also
// waits for the commit: when every new object is still in memory at Commit, the
// batch makes them durable with one journal sync and settles them later (see
// journal.go); otherwise it syncs up to bufferedSyncEach objects one by one, in
// parallel, rather than the whole filesystem (whose other writers' dirty data a
// syncfs would wait for too).
func (b *Batch) Buffer(limit int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buffered == nil {
		b.buffered = map[Hash][]byte{}
	}
	b.bufLeft = limit
	b.syncEach = bufferedSyncEach
}

// bufferedSyncEach is syncEach for a buffered batch.
const bufferedSyncEach = 1024

// syncWorkers bounds the fsyncs a commit runs at once.
const syncWorkers = 16

// buffer keeps data in memory if the buffer has room; it reports whether it did.
func (b *Batch) buffer(h Hash, data []byte) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buffered == nil || int64(len(data)) > b.bufLeft || b.done {
		return false
	}
	if _, dup := b.buffered[h]; !dup {
		b.buffered[h] = append([]byte(nil), data...)
		b.bufLeft -= int64(len(data))
	}
	return true
}

// Flush stages the objects kept in memory as temp files.
func (b *Batch) Flush() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.flushLocked()
}

func (b *Batch) flushLocked() error {
	for h, data := range b.buffered {
		if _, staged := b.pending[h]; staged {
			delete(b.buffered, h)
			continue
		}
		tmp, err := b.writeTemp(h, data)
		if err != nil {
			return err
		}
		b.pending[h] = tmp
		b.sizes[h] = int64(len(data))
		b.bufLeft += int64(len(data))
		delete(b.buffered, h)
	}
	return nil
}

// Begin starts a batch.
func (s *Store) Begin() (*Batch, error) {
	lf, err := s.lock(unix.LOCK_SH)
	if err != nil {
		return nil, err
	}
	s.sweepDeadOnce()
	return &Batch{s: s, lock: lf, pending: map[Hash]string{}, sizes: map[Hash]int64{}, reused: map[Hash]struct{}{}, syncEach: fsyncEach}, nil
}

// Hold takes the GC lock in shared mode, as a batch does, until release is called:
// garbage collection does not sweep meanwhile. Writers of records that name roots (a
// fork, a pin) check that the root exists and write the record under it, so a root
// is either recorded before a collection reads the live roots or already gone (and
// the check fails) when the record would be written.
func (s *Store) Hold() (release func(), err error) {
	lf, err := s.lock(unix.LOCK_SH)
	if err != nil {
		return nil, err
	}
	return func() { lf.Close() }, nil
}

// LockExclusive takes the GC lock in exclusive mode: it waits for running batches to
// finish and keeps new ones from starting until unlock is called.
func (s *Store) LockExclusive() (unlock func(), err error) {
	lf, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return nil, err
	}
	return func() { lf.Close() }, nil
}

func (s *Store) lock(how int) (*os.File, error) {
	// Read-only is enough for flock, and lets anyone who can read the store lock it.
	p := filepath.Join(s.root, lockFileName)
	lf, err := os.OpenFile(p, os.O_RDONLY|os.O_CREATE, 0o644&s.objPerm)
	if err != nil {
		return nil, fmt.Errorf("open store lock: %w", err)
	}
	_ = s.adopt(p)
	for {
		err = unix.Flock(int(lf.Fd()), how)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		lf.Close()
		return nil, fmt.Errorf("lock store %s: %w", s.root, err)
	}
	return lf, nil
}

// have reports whether h is already staged or stored. A stored object is remembered,
// and Commit refreshes its mtime so that garbage collection sees it as used now. (No
// collection can delete it in between: the sweep needs the lock exclusively.)
func (b *Batch) have(h Hash) bool {
	b.mu.Lock()
	_, staged := b.pending[h]
	_, buffered := b.buffered[h]
	b.mu.Unlock()
	if staged || buffered {
		return true
	}
	if _, err := os.Lstat(b.s.Path(h)); err != nil {
		return false
	}
	b.mu.Lock()
	b.reused[h] = struct{}{}
	b.mu.Unlock()
	return true
}

// stage adds a written temp file holding the size bytes that hash to h.
func (b *Batch) stage(h Hash, tmp string, size int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, dup := b.pending[h]; dup || b.done {
		os.Remove(tmp)
		return
	}
	b.pending[h] = tmp
	b.sizes[h] = size
}

func (b *Batch) createTemp() (*os.File, error) {
	f, err := os.CreateTemp(b.s.tmp, tempPrefix()+"*")
	if err != nil {
		return nil, fmt.Errorf("create temp object: %w", err)
	}
	return f, nil
}

// PutBytes stages data as an object.
func (b *Batch) PutBytes(data []byte) (Hash, error) {
	h := Sum(data)
	return h, b.putBytes(h, data)
}

// putBytes stages data, known to hash to h (or keeps it in memory, see Buffer).
func (b *Batch) putBytes(h Hash, data []byte) error {
	if b.have(h) || b.buffer(h, data) {
		return nil
	}
	tmp, err := b.writeTemp(h, data)
	if err != nil {
		return err
	}
	b.stage(h, tmp, int64(len(data)))
	return nil
}

// writeTemp writes data, known to hash to h, to a new temp file and returns its name.
func (b *Batch) writeTemp(h Hash, data []byte) (string, error) {
	f, err := b.createTemp()
	if err != nil {
		return "", err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("write object %s: %w", h, err)
	}
	return f.Name(), nil
}

// Put streams r into a staged object, hashing as it writes.
func (b *Batch) Put(r io.Reader) (Hash, error) {
	f, err := b.createTemp()
	if err != nil {
		return Hash{}, err
	}
	h, n, err := copyHashing(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return Hash{}, fmt.Errorf("write object: %w", err)
	}
	if b.have(h) {
		os.Remove(f.Name())
		return h, nil
	}
	b.stage(h, f.Name(), n)
	return h, nil
}

// PutFile stores the content of the regular file at path and returns its hash and
// size. Small files are read once; large ones are hashed first and copied only if the
// store lacks them, and the copy is re-hashed so a file that changes while it is read
// is an error rather than a mislabelled object.
func (b *Batch) PutFile(path string) (Hash, int64, error) {
	// Errors from the file's own operations already name it.
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return Hash{}, 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Hash{}, 0, err
	}
	if !st.Mode().IsRegular() {
		return Hash{}, 0, fmt.Errorf("read %s: not a regular file", path)
	}
	size := st.Size()
	if size <= smallFile {
		data := make([]byte, size+1)
		n, err := io.ReadFull(f, data)
		if err != io.ErrUnexpectedEOF && err != io.EOF {
			if err == nil {
				return Hash{}, 0, fmt.Errorf("read %s: file grew while it was being read", path)
			}
			return Hash{}, 0, err
		}
		if int64(n) != size {
			return Hash{}, 0, fmt.Errorf("read %s: file changed size while it was being read", path)
		}
		h, err := b.PutBytes(data[:n])
		return h, size, err
	}
	h, err := hashReaderAt(f, size)
	if err != nil {
		return Hash{}, 0, err
	}
	if b.have(h) {
		return h, size, nil
	}
	tf, err := b.createTemp()
	if err != nil {
		return Hash{}, 0, err
	}
	got, n, err := copyHashing(tf, io.NewSectionReader(f, 0, size+1))
	if cerr := tf.Close(); err == nil {
		err = cerr
	}
	if err == nil && (got != h || n != size) {
		err = errors.New("file changed while it was being read")
	}
	if err != nil {
		os.Remove(tf.Name())
		return Hash{}, 0, fmt.Errorf("read %s: %w", path, err)
	}
	b.stage(h, tf.Name(), size)
	return h, size, nil
}

// WriteTree encodes entries strictly and stages the tree object.
func (b *Batch) WriteTree(entries []Entry) (Hash, error) {
	data, err := EncodeTree(entries)
	if err != nil {
		return Hash{}, err
	}
	return b.PutBytes(data)
}

// Commit publishes every staged object durably (data synced before the rename, the
// directory entries synced after it) and releases the lock.
func (b *Batch) Commit() error {
	release, err := b.Publish()
	if release != nil {
		release()
	}
	return err
}

// Publish is Commit without releasing the GC lock: the caller records what it wrote
// (a fork's new root) before calling release, so no collection can run between the
// objects' publication and the record that keeps them. release is nil on error (the
// lock is released then).
func (b *Batch) Publish() (release func(), err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return nil, errors.New("batch already finished")
	}
	b.done = true
	// A buffered batch whose new objects are all in memory journals them: one sync
	// instead of one per object and directory (see journal.go).
	if len(b.pending) == 0 && len(b.buffered) > 0 {
		if journal, err := b.s.writeJournal(b.buffered); err == nil {
			b.journal = journal
			return b.publishLate(), nil
		} else {
			log.L.WithError(err).Warn("store: journal not written; syncing objects one by one")
		}
	}
	if err := b.flushLocked(); err != nil {
		b.removePending()
		b.dropJournal()
		b.lock.Close()
		return nil, err
	}
	if err := b.publish(); err != nil {
		b.dropJournal()
		b.lock.Close()
		return nil, err
	}
	lf := b.lock
	return func() { lf.Close() }, nil
}

// touchReused gives the stored objects the batch relies on the publication time, now,
// which it returns.
func (b *Batch) touchReused() time.Time {
	now := time.Now()
	for h := range b.reused {
		if _, staged := b.pending[h]; !staged {
			_ = os.Chtimes(b.s.Path(h), now, now) // best effort: a read-only LunarFS store still works
		}
	}
	return now
}

func (b *Batch) publish() error {
	// Publication time, not write time, is what garbage collection's grace period
	// must count from: the caller references these objects only after Commit. Reused
	// objects get the same time, so a new tree is never younger than what it names.
	now := b.touchReused()
	if len(b.pending) == 0 {
		return nil
	}
	if b.journal != "" {
		return b.publishJournaled(now)
	}
	few := len(b.pending) <= b.syncEach
	if few {
		if err := b.syncPending(); err != nil {
			b.removePending()
			return err
		}
	} else if err := b.s.syncfs(); err != nil {
		b.removePending()
		return err
	}
	dirs := map[string]struct{}{}
	published := make([]SizeEntry, 0, len(b.pending))
	for h, tmp := range b.pending {
		_ = os.Chtimes(tmp, now, now)
		if b.s.objPerm != 0o600 {
			if err := os.Chmod(tmp, b.s.objPerm); err != nil {
				b.removePending()
				return fmt.Errorf("publish object %s: %w", h, err)
			}
		}
		if err := b.s.adopt(tmp); err != nil {
			b.removePending()
			return fmt.Errorf("publish object %s: %w", h, err)
		}
		final := b.s.Path(h)
		dir := filepath.Dir(final)
		if err := b.s.ensureFanout(dir); err != nil {
			b.removePending()
			return err
		}
		if err := os.Rename(tmp, final); err != nil {
			b.removePending()
			return fmt.Errorf("publish object %s: %w", h, err)
		}
		delete(b.pending, h)
		dirs[dir] = struct{}{}
		published = append(published, SizeEntry{Hash: h, Size: b.sizes[h]})
	}
	if !few {
		if err := b.s.syncfs(); err != nil {
			return err
		}
	} else {
		paths := make([]string, 0, len(dirs))
		for d := range dirs {
			paths = append(paths, d)
		}
		if err := syncAll(paths); err != nil {
			return err
		}
	}
	// Only now are the objects durable: a size index entry must never outlive its
	// object across a crash. The index is an optimization, so failing to append to
	// it (a read-only LunarFS store) fails nothing.
	_ = b.s.sizes.add(published)
	return nil
}

// publishLate publishes a journaled batch's objects in the background (see late.go)
// and returns the caller's release: the GC lock is released once both the caller and
// the background publication are done.
func (b *Batch) publishLate() (release func()) {
	now := b.touchReused()
	hashes := make([]Hash, 0, len(b.buffered))
	for h := range b.buffered {
		hashes = append(hashes, h)
	}
	b.s.addLate(b.buffered)
	var holders atomic.Int32
	holders.Store(2)
	lf := b.lock
	done := func() {
		if holders.Add(-1) == 0 {
			lf.Close()
		}
	}
	b.s.late.running.Add(1)
	go func() {
		defer b.s.late.running.Done()
		defer done()
		if publishLateHook != nil {
			publishLateHook()
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		err := b.flushLocked()
		if err == nil {
			err = b.publishJournaled(now)
		}
		if err != nil {
			// The journal still holds the objects durably and the late objects keep
			// them readable here; a later start replays the journal.
			b.removePending()
			log.L.WithError(err).WithField("journal", b.journal).Error("store: publishing a journaled batch failed; its objects stay in the journal")
			return
		}
		b.s.dropLate(hashes)
	}()
	var once sync.Once
	return func() { once.Do(done) }
}

// publishJournaled publishes the staged objects, which the batch's journal already
// holds durably, without syncing them; they are settled later (see journal.go).
func (b *Batch) publishJournaled(now time.Time) error {
	objects := make([]string, 0, len(b.pending))
	published := make([]SizeEntry, 0, len(b.pending))
	for h, tmp := range b.pending {
		_ = os.Chtimes(tmp, now, now)
		final := b.s.Path(h)
		err := error(nil)
		if b.s.objPerm != 0o600 {
			err = os.Chmod(tmp, b.s.objPerm)
		}
		if err == nil {
			err = b.s.adopt(tmp)
		}
		if err == nil {
			err = b.s.ensureFanout(filepath.Dir(final))
		}
		if err == nil {
			err = os.Rename(tmp, final)
		}
		if err != nil {
			b.removePending()
			return fmt.Errorf("publish object %s: %w", h, err)
		}
		delete(b.pending, h)
		objects = append(objects, final)
		published = append(published, SizeEntry{Hash: h, Size: b.sizes[h]})
	}
	b.s.queueSettle(journaled{journal: b.journal, objects: objects, published: published})
	b.journal = ""
	return nil
}

// dropJournal removes the batch's journal when its objects were not published.
func (b *Batch) dropJournal() {
	if b.journal != "" {
		os.Remove(b.journal)
		b.journal = ""
	}
}

// syncPending fsyncs every staged object, several at once: the filesystem's
// journal commits them together.
func (b *Batch) syncPending() error {
	paths := make([]string, 0, len(b.pending))
	for _, tmp := range b.pending {
		paths = append(paths, tmp)
	}
	return syncAll(paths)
}

// syncAll fsyncs paths with up to syncWorkers at once; the first error wins.
func syncAll(paths []string) error {
	if len(paths) <= 1 {
		for _, p := range paths {
			if err := fsyncPath(p); err != nil {
				return fmt.Errorf("sync %s: %w", p, err)
			}
		}
		return nil
	}
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
		next  = make(chan string)
	)
	for i := 0; i < min(syncWorkers, len(paths)); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range next {
				if err := fsyncPath(p); err != nil {
					once.Do(func() { first = fmt.Errorf("sync %s: %w", p, err) })
				}
			}
		}()
	}
	for _, p := range paths {
		next <- p
	}
	close(next)
	wg.Wait()
	return first
}

// Abort discards staged objects and releases the lock. It is a no-op after Commit.
func (b *Batch) Abort() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return
	}
	b.done = true
	b.removePending()
	b.lock.Close()
}

func (b *Batch) removePending() {
	for h := range b.buffered {
		delete(b.buffered, h)
	}
	for h, tmp := range b.pending {
		os.Remove(tmp)
		delete(b.pending, h)
	}
}

func (s *Store) ensureFanout(dir string) error {
	if _, ok := s.fanout.Load(dir); ok {
		return nil
	}
	if err := os.Mkdir(dir, s.dirPerm); err == nil {
		// The umask may have taken bits away; the root directory's mode is the rule.
		if err := os.Chmod(dir, s.dirPerm); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		if err := s.adopt(dir); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	s.fanout.Store(dir, struct{}{})
	return nil
}

func (s *Store) syncfs() error {
	fd, err := unix.Open(s.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("sync store: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return fmt.Errorf("sync store: %w", err)
	}
	return nil
}

func fsyncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

func copyHashing(w io.Writer, r io.Reader) (Hash, int64, error) {
	hs := getHasher()
	defer putHasher(hs)
	buf := getBuf()
	defer putBuf(buf)
	n, err := io.CopyBuffer(io.MultiWriter(w, hs), r, *buf)
	var h Hash
	hs.Sum(h[:0])
	return h, n, err
}

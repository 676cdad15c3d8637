package casstore

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"lukechampine.com/blake3"
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
// refreshes the mtime of every existing object it relies on, so a concurrent garbage
// collection neither deletes an object the batch is about to reference nor sweeps the
// result before its grace period ends.
type Batch struct {
	s    *Store
	lock *os.File

	mu      sync.Mutex
	pending map[Hash]string // object -> staged temp file
	done    bool
}

// Begin starts a batch.
func (s *Store) Begin() (*Batch, error) {
	lf, err := s.lock(unix.LOCK_SH)
	if err != nil {
		return nil, err
	}
	return &Batch{s: s, lock: lf, pending: map[Hash]string{}}, nil
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
	lf, err := os.OpenFile(filepath.Join(s.root, lockFileName), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open store lock: %w", err)
	}
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

// have reports whether h is already staged or stored; a stored object's mtime is
// refreshed so that garbage collection sees it as recently used.
func (b *Batch) have(h Hash) bool {
	b.mu.Lock()
	_, staged := b.pending[h]
	b.mu.Unlock()
	if staged {
		return true
	}
	p := b.s.Path(h)
	if _, err := os.Lstat(p); err != nil {
		return false
	}
	now := time.Now()
	_ = os.Chtimes(p, now, now) // best effort: a read-only LunarFS store still works
	return true
}

func (b *Batch) stage(h Hash, tmp string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, dup := b.pending[h]; dup || b.done {
		os.Remove(tmp)
		return
	}
	b.pending[h] = tmp
}

func (b *Batch) createTemp() (*os.File, error) {
	f, err := os.CreateTemp(b.s.tmp, "obj-*")
	if err != nil {
		return nil, fmt.Errorf("create temp object: %w", err)
	}
	return f, nil
}

// PutBytes stages data as an object.
func (b *Batch) PutBytes(data []byte) (Hash, error) {
	h := Sum(data)
	if b.have(h) {
		return h, nil
	}
	f, err := b.createTemp()
	if err != nil {
		return Hash{}, err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return Hash{}, fmt.Errorf("write object %s: %w", h, err)
	}
	b.stage(h, f.Name())
	return h, nil
}

// Put streams r into a staged object, hashing as it writes.
func (b *Batch) Put(r io.Reader) (Hash, error) {
	f, err := b.createTemp()
	if err != nil {
		return Hash{}, err
	}
	h, _, err := copyHashing(f, r)
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
	b.stage(h, f.Name())
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
	b.stage(h, tf.Name())
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
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return errors.New("batch already finished")
	}
	b.done = true
	defer b.lock.Close()
	if len(b.pending) == 0 {
		return nil
	}
	few := len(b.pending) <= fsyncEach
	if few {
		for h, tmp := range b.pending {
			if err := fsyncPath(tmp); err != nil {
				b.removePending()
				return fmt.Errorf("sync object %s: %w", h, err)
			}
		}
	} else if err := b.s.syncfs(); err != nil {
		b.removePending()
		return err
	}
	// Publication time, not write time, is what garbage collection's grace period
	// must count from: the caller references these objects only after Commit.
	now := time.Now()
	dirs := map[string]struct{}{}
	for h, tmp := range b.pending {
		_ = os.Chtimes(tmp, now, now)
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
	}
	if !few {
		return b.s.syncfs()
	}
	for d := range dirs {
		if err := fsyncPath(d); err != nil {
			return fmt.Errorf("sync %s: %w", d, err)
		}
	}
	return nil
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
	for h, tmp := range b.pending {
		os.Remove(tmp)
		delete(b.pending, h)
	}
}

func (s *Store) ensureFanout(dir string) error {
	if _, ok := s.fanout.Load(dir); ok {
		return nil
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
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
	hs := blake3.New(HashSize, nil)
	buf := getBuf()
	defer putBuf(buf)
	n, err := io.CopyBuffer(io.MultiWriter(w, hs), r, *buf)
	var h Hash
	hs.Sum(h[:0])
	return h, n, err
}

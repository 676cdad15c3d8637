package casstore

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"
)

const (
	tmpDirName   = ".tidepool-tmp"
	lockFileName = ".tidepool-gc.lock"
	// QuarantineDirName is where fsck moves objects whose bytes do not match their name.
	QuarantineDirName = ".quarantine"
	// maxTreeSize bounds how much of an object is read when it is used as a tree, so a
	// hostile root that points a directory entry at a huge blob cannot exhaust memory.
	maxTreeSize = 256 << 20
)

// CorruptError says an object's bytes do not hash to its name, or (Reason) that its
// compressed bytes do not even decode. It wraps errdefs.ErrDataLoss so callers across
// gRPC see a data-loss status.
type CorruptError struct {
	Hash   Hash // the name the object is stored under
	Got    Hash // what its bytes hash to
	Path   string
	Reason string // set when the bytes could not be decoded (Got is then zero)
}

func (e *CorruptError) Error() string {
	if e.Reason != "" {
		return fmt.Sprintf("object %s is corrupt: %s (%s)", e.Hash, e.Reason, e.Path)
	}
	return fmt.Sprintf("object %s is corrupt: its bytes hash to %s (%s)", e.Hash, e.Got, e.Path)
}

// Unwrap lets errors.Is(err, errdefs.ErrDataLoss) match.
func (e *CorruptError) Unwrap() error { return errdefs.ErrDataLoss }

// fileID identifies one version of an object file, so a verification stays valid only
// while the file it was made on is unchanged.
type fileID struct {
	dev, ino uint64
	size     int64
	mtime    int64
}

func fileIDOf(st *unix.Stat_t) fileID {
	return fileID{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano()}
}

// Store is a LunarFS-layout object store rooted at one directory.
type Store struct {
	root     string
	tmp      string
	verified sync.Map // Hash -> fileID
	verifyMu singleflight.Group
	fanout   sync.Map // "hh" -> struct{}: fan-out directories known to exist
	deadOnce sync.Once
	// Who the store belongs to, from its root directory: new fan-out directories and
	// objects follow it (see Open).
	dirPerm, objPerm os.FileMode
	uid, gid         int
	chown            bool
	sizes            *sizeIndex
	settle           settler     // journaled batches waiting to be made durable in place
	late             lateObjects // journaled objects not yet under their names
}

// Open opens (creating if needed) the store at root. root may be an existing LunarFS
// store such as ~/.lunar/cas: Tidepool adds only dot-directories beside the fan-out.
//
// A store Open creates (and any missing parent, such as Tidepool's ROOT) is 0700:
// nothing under it is anyone else's business. An existing store keeps its owner and
// modes: new fan-out directories get the root directory's mode, objects are readable
// by whoever can read the root directory, and when root writes into another user's
// store (a LunarFS store given with --store), what it creates is given to that user,
// so LunarFS keeps working there.
func Open(root string) (*Store, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", root, err)
	}
	s := &Store{root: abs, tmp: filepath.Join(abs, tmpDirName)}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("open store %s: %w", root, err)
	}
	st, err := os.Stat(abs)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", root, err)
	}
	s.dirPerm = st.Mode().Perm()
	s.objPerm = 0o600
	if s.dirPerm&0o044 != 0 {
		s.objPerm = 0o644
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && os.Geteuid() == 0 && sys.Uid != 0 {
		s.uid, s.gid, s.chown = int(sys.Uid), int(sys.Gid), true
	}
	if err := os.Mkdir(s.tmp, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("open store %s: %w", root, err)
	}
	s.sizes = newSizeIndex(s)
	return s, nil
}

// adopt gives a new file or directory of the store its owner (see Open).
func (s *Store) adopt(path string) error {
	if !s.chown {
		return nil
	}
	return os.Lchown(path, s.uid, s.gid)
}

// Root is the store's directory.
func (s *Store) Root() string { return s.root }

// Path is where the object named h lives (whether or not it exists).
func (s *Store) Path(h Hash) string {
	x := h.String()
	return filepath.Join(s.root, x[:2], x[2:])
}

// Has reports whether the object exists locally.
func (s *Store) Has(h Hash) (bool, error) {
	_, err := os.Lstat(s.Path(h))
	if s.materialized(h, err) {
		err = nil
	}
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	default:
		return false, fmt.Errorf("stat object %s: %w", h, err)
	}
}

// Size returns an object's length from its file's metadata, without reading it.
func (s *Store) Size(h Hash) (int64, error) {
	st, err := os.Stat(s.Path(h))
	if s.materialized(h, err) {
		st, err = os.Stat(s.Path(h))
	}
	if err != nil {
		return 0, s.notFound(h, err)
	}
	return st.Size(), nil
}

// openObject opens an object's file, materializing it first if it is published
// late (late.go).
func (s *Store) openObject(h Hash) (*os.File, error) {
	f, err := os.Open(s.Path(h))
	if s.materialized(h, err) {
		f, err = os.Open(s.Path(h))
	}
	return f, err
}

// materialized reports whether err says an object is missing and Materialize has
// just put it in place, so the caller should look again.
func (s *Store) materialized(h Hash, err error) bool {
	if !errors.Is(err, fs.ErrNotExist) {
		return false
	}
	ok, merr := s.Materialize(h)
	if merr != nil {
		log.L.WithError(merr).WithField("object", h.String()).Warn("store: a missing object could not be written from its journal")
	}
	return ok
}

func (s *Store) notFound(h Hash, err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("object %s: %w", h, errdefs.ErrNotFound)
	}
	return fmt.Errorf("object %s: %w", h, err)
}

// Open returns the object's file, positioned at 0, after checking that its bytes hash
// to h. The check runs once per process for a given version of the file (same inode,
// size and mtime); concurrent first opens share one check.
func (s *Store) Open(h Hash) (*os.File, error) {
	f, err := s.openObject(h)
	if err != nil {
		return nil, s.notFound(h, err)
	}
	if err := s.verifyOpen(h, f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func (s *Store) verifyOpen(h Hash, f *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("object %s: fstat: %w", h, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("object %s: %s is not a regular file", h, f.Name())
	}
	id := fileIDOf(&st)
	if v, ok := s.verified.Load(h); ok && v.(fileID) == id {
		return nil
	}
	key := fmt.Sprintf("%s/%d/%d", h, id.ino, id.mtime)
	_, err, _ := s.verifyMu.Do(key, func() (any, error) {
		if v, ok := s.verified.Load(h); ok && v.(fileID) == id {
			return nil, nil
		}
		got, err := hashReaderAt(f, st.Size)
		if err != nil {
			return nil, fmt.Errorf("object %s: read: %w", h, err)
		}
		if got != h {
			return nil, &CorruptError{Hash: h, Got: got, Path: f.Name()}
		}
		s.verified.Store(h, id)
		return nil, nil
	})
	return err
}

// hashReaderAt hashes the first size bytes of f without moving its offset, so the
// caller can hand f on positioned at 0.
func hashReaderAt(f *os.File, size int64) (Hash, error) {
	hs := getHasher()
	defer putHasher(hs)
	buf := getBuf()
	defer putBuf(buf)
	if _, err := io.CopyBuffer(hs, io.NewSectionReader(f, 0, size), *buf); err != nil {
		return Hash{}, err
	}
	var h Hash
	hs.Sum(h[:0])
	return h, nil
}

// Verify re-hashes an object regardless of earlier checks (fsck).
func (s *Store) Verify(h Hash) error {
	f, err := s.openObject(h)
	if err != nil {
		return s.notFound(h, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("object %s: %w", h, err)
	}
	got, err := hashReaderAt(f, st.Size())
	if err != nil {
		return fmt.Errorf("object %s: read: %w", h, err)
	}
	if got != h {
		s.verified.Delete(h)
		return &CorruptError{Hash: h, Got: got, Path: f.Name()}
	}
	return nil
}

// ReadAll returns a whole object, verified. Use it for small objects (trees, symlink
// targets); stream file content with Open instead.
func (s *Store) ReadAll(h Hash, max int64) ([]byte, error) {
	f, err := s.openObject(h)
	if err != nil {
		return nil, s.notFound(h, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("object %s: %w", h, err)
	}
	if st.Size() > max {
		return nil, fmt.Errorf("object %s: %d bytes is more than the %d allowed here", h, st.Size(), max)
	}
	b := make([]byte, st.Size())
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, fmt.Errorf("object %s: read: %w", h, err)
	}
	if got := Sum(b); got != h {
		return nil, &CorruptError{Hash: h, Got: got, Path: f.Name()}
	}
	return b, nil
}

// ReadTree reads, verifies and decodes a tree object.
func (s *Store) ReadTree(h Hash) (Tree, error) {
	if h == EmptyHash {
		return nil, nil
	}
	b, err := s.ReadAll(h, maxTreeSize)
	if err != nil {
		return nil, err
	}
	t, err := DecodeTree(b)
	if err != nil {
		return nil, fmt.Errorf("tree %s: %w", h, err)
	}
	return t, nil
}

// WriteTree encodes and stores a tree in a batch of its own.
func (s *Store) WriteTree(entries []Entry) (Hash, error) {
	b, err := s.Begin()
	if err != nil {
		return Hash{}, err
	}
	defer b.Abort()
	h, err := b.WriteTree(entries)
	if err != nil {
		return Hash{}, err
	}
	return h, b.Commit()
}

// PutBytes stores b durably in a batch of its own.
func (s *Store) PutBytes(data []byte) (Hash, error) {
	b, err := s.Begin()
	if err != nil {
		return Hash{}, err
	}
	defer b.Abort()
	h, err := b.PutBytes(data)
	if err != nil {
		return Hash{}, err
	}
	return h, b.Commit()
}

// Put streams r into the store durably in a batch of its own.
func (s *Store) Put(r io.Reader) (Hash, error) {
	b, err := s.Begin()
	if err != nil {
		return Hash{}, err
	}
	defer b.Abort()
	h, err := b.Put(r)
	if err != nil {
		return Hash{}, err
	}
	return h, b.Commit()
}

// SweepTemp removes temp files older than age: Tidepool's own and the "<hex>.tmp"
// files LunarFS leaves behind in fan-out directories. Younger files may belong to a
// writer that is still running.
func (s *Store) SweepTemp(age time.Duration) (int, error) {
	cutoff := time.Now().Add(-age)
	n := 0
	sweep := func(dir string, match func(string) bool) error {
		ents, err := os.ReadDir(dir)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		for _, e := range ents {
			if e.IsDir() || !match(e.Name()) {
				continue
			}
			info, err := e.Info()
			if err != nil || info.ModTime().After(cutoff) {
				continue
			}
			if os.Remove(filepath.Join(dir, e.Name())) == nil {
				n++
			}
		}
		return nil
	}
	if err := sweep(s.tmp, func(string) bool { return true }); err != nil {
		return n, fmt.Errorf("sweep temp files: %w", err)
	}
	err := s.ForEachFanout(func(dir string) error {
		return sweep(dir, func(name string) bool { return filepath.Ext(name) == ".tmp" })
	})
	if err != nil {
		return n, fmt.Errorf("sweep temp files: %w", err)
	}
	return n, nil
}

// ForEachFanout calls fn for every two-hex-digit fan-out directory that exists.
func (s *Store) ForEachFanout(fn func(dir string) error) error {
	ents, err := os.ReadDir(s.root)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if e.IsDir() && isFanoutName(e.Name()) {
			if err := fn(filepath.Join(s.root, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

func isFanoutName(n string) bool {
	return len(n) == 2 && isLowerHex(n[0]) && isLowerHex(n[1])
}

func isLowerHex(c byte) bool { return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' }

// Walk calls fn for every object file in the store, with its hash. Files whose names
// are not object names (temp files, strays) are skipped.
func (s *Store) Walk(fn func(h Hash, path string) error) error {
	return s.ForEachFanout(func(dir string) error {
		ents, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		prefix := filepath.Base(dir)
		for _, e := range ents {
			if e.IsDir() || len(e.Name()) != 2*HashSize-2 {
				continue
			}
			h, err := ParseHash(prefix + e.Name())
			if err != nil {
				continue
			}
			if err := fn(h, filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
		return nil
	})
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 256<<10); return &b }}

func getBuf() *[]byte  { return bufPool.Get().(*[]byte) }
func putBuf(b *[]byte) { bufPool.Put(b) }

package casstore

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// The size index (STORE/.tidepool-sizes) records the length of every object a batch
// publishes, so that a reader who needs the sizes of a whole tree's files (a kernel
// view's image) need not stat each object. LunarFS trees carry no sizes.
//
// It is an append-only log of fixed 48-byte records: the hash (32 bytes), the size
// (u64 LE; all ones: "forgotten") and a check (the first 8 bytes of BLAKE3 of the
// first 40). Its rules keep a wrong answer impossible short of a corrupt object:
//
//   - A size is a property of the hash (the length of the bytes that hash to it),
//     recorded from the bytes the batch itself hashed, never from a stat.
//   - An entry is appended only after its object is durable (synced and renamed, the
//     directory synced), so a surviving entry never names an object a crash lost.
//   - Whatever removes objects (garbage collection, fsck's quarantine) first appends
//     "forgotten" records and syncs them (ForgetSizes), under the store's exclusive
//     lock; an entry therefore also means "present", as long as only Tidepool removes
//     objects.
//   - A torn or garbage record fails its check and is skipped; two live entries that
//     disagree make the hash unknown. Unknown means the caller stats the object.
//   - A crash mid-append leaves a partial record at the end; the next writer pads it
//     to a record boundary (under flock) so that later records stay aligned.
//   - A reader follows the file it read so far by its device and inode number and
//     by its first record, and starts over when any of them changes: a file that
//     replaced it (compaction) can get the same inode number back once the one in
//     between is gone too, so compaction starts its file with a record of its own
//     (the forgetting of a random hash, which forgets nothing).
//
// Losing the file loses nothing but speed.
const (
	sizeIndexName = ".tidepool-sizes"
	sizeRecordLen = 48
	sizeForgotten = ^uint64(0)
	// maxObjectSize bounds the sizes the index believes (2^62 bytes).
	maxObjectSize = 1 << 62
)

// SizeEntry is an object's length, as the size index records it.
type SizeEntry struct {
	Hash Hash
	Size int64
}

type sizeIndex struct {
	path  string
	perm  os.FileMode
	adopt func(string) error

	mu       sync.RWMutex
	dev, ino uint64              // the file read so far
	off      int64               // how much of f has been read (a record boundary)
	first    [sizeRecordLen]byte // the file's first record, once read
	m        map[Hash]int64      // -1: entries that disagree
	// losses counts the records read from this file that forgot or spoiled an entry
	// (SizeEpoch).
	losses uint64
}

func newSizeIndex(s *Store) *sizeIndex {
	return &sizeIndex{path: filepath.Join(s.root, sizeIndexName), perm: s.objPerm, adopt: s.adopt}
}

func sizeCheck(rec []byte) uint64 {
	sum := Sum(rec[:40])
	return binary.LittleEndian.Uint64(sum[:8])
}

func appendSizeRecord(buf []byte, h Hash, size uint64) []byte {
	start := len(buf)
	buf = append(buf, h[:]...)
	buf = binary.LittleEndian.AppendUint64(buf, size)
	return binary.LittleEndian.AppendUint64(buf, sizeCheck(buf[start:]))
}

// KnownSize returns the size the index records for h, as of the last RefreshSizes.
// ok is false when the index has no usable entry (never recorded, forgotten, or
// entries that disagree): the caller must stat the object. An entry also means that
// the object is in the store, unless something other than Tidepool removed it.
func (s *Store) KnownSize(h Hash) (int64, bool) {
	x := s.sizes
	x.mu.RLock()
	v, ok := x.m[h]
	x.mu.RUnlock()
	return v, ok && v >= 0
}

// KnownSizes calls fn for every usable entry of the size index, as of the last
// RefreshSizes (fsck compares them with the objects).
func (s *Store) KnownSizes(fn func(h Hash, size int64)) {
	x := s.sizes
	x.mu.RLock()
	defer x.mu.RUnlock()
	for h, v := range x.m {
		if v >= 0 {
			fn(h, v)
		}
	}
}

// RefreshSizes reads what any process appended to the size index since the last
// call (the whole index on the first call, or when the file was replaced).
func (s *Store) RefreshSizes() error {
	x := s.sizes
	x.mu.Lock()
	defer x.mu.Unlock()
	f, err := os.Open(x.path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			x.reset()
			return nil
		}
		return fmt.Errorf("size index: %w", err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("size index: %w", err)
	}
	// Another file than last time (compacted, or removed and recreated), or one cut
	// short by hand: start over.
	replaced := x.m == nil || st.Dev != x.dev || st.Ino != x.ino || st.Size < x.off
	if !replaced && x.off >= sizeRecordLen {
		// The same inode number can be another file: its first record tells.
		var first [sizeRecordLen]byte
		if _, err := f.ReadAt(first[:], 0); err != nil {
			return fmt.Errorf("size index: %w", err)
		}
		replaced = first != x.first
	}
	if replaced {
		x.reset()
		x.dev, x.ino = st.Dev, st.Ino
	}
	end := st.Size - st.Size%sizeRecordLen // a partial record is still being written, or torn
	if end <= x.off {
		return nil
	}
	buf := make([]byte, min(end-x.off, 1<<20))
	for x.off < end {
		want := min(int64(len(buf)), end-x.off)
		n, err := f.ReadAt(buf[:want], x.off)
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("size index: %w", err)
		}
		n -= n % sizeRecordLen
		if x.off == 0 && n > 0 {
			copy(x.first[:], buf)
		}
		x.apply(buf[:n])
		x.off += int64(n)
		if int64(n) < want {
			break
		}
	}
	return nil
}

func (x *sizeIndex) reset() {
	x.off, x.dev, x.ino, x.losses = 0, 0, 0, 0
	x.first = [sizeRecordLen]byte{}
	x.m = map[Hash]int64{}
}

// SizeEpoch is where the size index stood at the last RefreshSizes, for a reader that
// found a set of objects in it (KnownSize) and wants to know later whether they would
// all still be found without asking again: they would as long as the epoch is the
// same, since it changes with every record that forgets or spoils an entry and
// whenever the index file is replaced. Records that only add entries leave it as it is.
type SizeEpoch struct {
	dev, ino uint64
	first    [sizeRecordLen]byte
	losses   uint64
}

// SizeEpoch returns the size index's epoch as of the last RefreshSizes; ok is false
// when there is no index (nothing is known, so no answer can be kept).
func (s *Store) SizeEpoch() (e SizeEpoch, ok bool) {
	x := s.sizes
	x.mu.RLock()
	defer x.mu.RUnlock()
	return SizeEpoch{dev: x.dev, ino: x.ino, first: x.first, losses: x.losses}, x.m != nil && x.off > 0
}

// apply folds whole records into the map.
func (x *sizeIndex) apply(b []byte) {
	for ; len(b) >= sizeRecordLen; b = b[sizeRecordLen:] {
		rec := b[:sizeRecordLen]
		if binary.LittleEndian.Uint64(rec[40:]) != sizeCheck(rec) {
			continue // torn or garbage
		}
		var h Hash
		copy(h[:], rec)
		size := binary.LittleEndian.Uint64(rec[32:])
		switch old, ok := x.m[h]; {
		case size == sizeForgotten:
			delete(x.m, h)
			x.losses++
		case size >= maxObjectSize:
			// A well-formed record with a nonsense size: trust nothing about h.
			x.m[h] = -1
			x.losses++
		case !ok:
			x.m[h] = int64(size)
		case old != int64(size):
			x.m[h] = -1
			x.losses++
		}
	}
}

// add appends entries for objects that are durable in the store.
func (x *sizeIndex) add(entries []SizeEntry) error {
	if len(entries) == 0 {
		return nil
	}
	buf := make([]byte, 0, len(entries)*sizeRecordLen)
	for _, e := range entries {
		buf = appendSizeRecord(buf, e.Hash, uint64(e.Size))
	}
	return x.append(buf, false)
}

// ForgetSizes records that the objects hs are about to leave the store, durably,
// before they do: whatever removes objects calls it first, holding the store's
// exclusive lock (see LockExclusive). If it fails, the objects must stay.
func (s *Store) ForgetSizes(hs []Hash) error {
	if len(hs) == 0 {
		return nil
	}
	if _, err := os.Lstat(s.sizes.path); errors.Is(err, fs.ErrNotExist) {
		return nil // no index, nothing to forget
	}
	buf := make([]byte, 0, len(hs)*sizeRecordLen)
	for _, h := range hs {
		buf = appendSizeRecord(buf, h, sizeForgotten)
	}
	return s.sizes.append(buf, true)
}

// append writes whole records at the end of the index, after padding a partial
// record a crash left there, under an exclusive flock so that two writers' padding
// and records never interleave.
func (x *sizeIndex) append(recs []byte, sync bool) error {
	f, err := os.OpenFile(x.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, x.perm)
	if err != nil {
		return fmt.Errorf("size index: %w", err)
	}
	defer f.Close()
	_ = x.adopt(x.path)
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("size index: lock: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("size index: %w", err)
	}
	if r := st.Size() % sizeRecordLen; r != 0 {
		recs = append(make([]byte, sizeRecordLen-r, int(sizeRecordLen-r)+len(recs)), recs...)
	}
	if _, err := f.Write(recs); err != nil {
		return fmt.Errorf("size index: %w", err)
	}
	if sync {
		if err := f.Sync(); err != nil {
			return fmt.Errorf("size index: %w", err)
		}
	}
	return nil
}

// CompactSizes rewrites the size index with only its live entries when forgotten
// and duplicate records make up most of it. The caller holds the store's exclusive
// lock, so no batch appends meanwhile.
func (s *Store) CompactSizes() error {
	x := s.sizes
	b, err := os.ReadFile(x.path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("size index: %w", err)
	}
	tmp := &sizeIndex{m: map[Hash]int64{}}
	tmp.apply(b[:len(b)-len(b)%sizeRecordLen])
	live := 0
	for _, v := range tmp.m {
		if v >= 0 {
			live++
		}
	}
	if records := len(b) / sizeRecordLen; records < 1024 || records < 2*live {
		return nil
	}
	// The new file's first record is its own (see the size index's rules above): the
	// forgetting of a random hash.
	var nonce Hash
	if _, err := rand.Read(nonce[:]); err != nil {
		return fmt.Errorf("size index: compact: %w", err)
	}
	out := appendSizeRecord(make([]byte, 0, (1+live)*sizeRecordLen), nonce, sizeForgotten)
	for h, v := range tmp.m {
		if v >= 0 {
			out = appendSizeRecord(out, h, uint64(v))
		}
	}
	f, err := os.CreateTemp(s.tmp, "sizes-")
	if err != nil {
		return fmt.Errorf("size index: %w", err)
	}
	defer os.Remove(f.Name())
	_, err = f.Write(out)
	if err == nil {
		err = f.Chmod(x.perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = x.adopt(f.Name())
	}
	if err == nil {
		err = os.Rename(f.Name(), x.path)
	}
	if err == nil {
		err = fsyncPath(s.root)
	}
	if err != nil {
		return fmt.Errorf("size index: compact: %w", err)
	}
	return nil
}

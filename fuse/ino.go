package fuse

import (
	"encoding/binary"
	"sync"

	"lukechampine.com/blake3"
)

// inoBits keeps inode numbers below 2^56, leaving the top bits free for overlayfs's
// xino scheme (which folds a layer index into the high bits of lower inode numbers).
const inoBits = 56

// rootIno is the view root's inode number (FUSE's root node id).
const rootIno = 1

// inoTable gives every path of a view a stable inode number: a hash of the path, so
// the same path gets the same number in every mount of a view of the same root, and
// two paths sharing a blob still get different numbers. The table remembers what it
// handed out, so the (astronomically rare) hash collision is resolved by rehashing
// instead of silently merging two files.
type inoTable struct {
	mu     sync.Mutex
	byIno  map[uint64]string
	byPath map[string]uint64
}

func newInoTable() *inoTable {
	return &inoTable{byIno: map[uint64]string{}, byPath: map[string]uint64{}}
}

func (t *inoTable) ino(path string) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ino, ok := t.byPath[path]; ok {
		return ino
	}
	for salt := uint64(0); ; salt++ {
		ino := hashIno(path, salt)
		if ino <= rootIno {
			continue
		}
		if _, taken := t.byIno[ino]; taken {
			continue
		}
		t.byIno[ino] = path
		t.byPath[path] = ino
		return ino
	}
}

func hashIno(path string, salt uint64) uint64 {
	h := blake3.New(8, nil)
	var s [8]byte
	binary.LittleEndian.PutUint64(s[:], salt)
	h.Write(s[:])
	h.Write([]byte(path))
	var sum [8]byte
	h.Sum(sum[:0])
	return binary.LittleEndian.Uint64(sum[:]) & (1<<inoBits - 1)
}

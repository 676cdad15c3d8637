package casstore

import (
	"fmt"
	"sync"

	"github.com/pierrec/lz4/v4"
)

// Objects may travel and wait in journals compressed: a remote's pack carries each
// object as its raw bytes or, when that is smaller, as one LZ4 block (the block
// format, without a frame: the object's size is known from the entry), and a journal
// written from a pack keeps the block as it came. A pull of a source tree then moves
// and syncs well under half its bytes, while every object is still decoded and
// hashed against its name before it is journaled, and decoded and hashed again
// before it is written under its name. Objects under their names are always raw
// (LunarFS's layout).
//
// LZ4 (github.com/pierrec/lz4/v4, with assembly decoders) rather than S2 or zstd: a
// pull's CPU goes into decoding and hashing every byte, and on the Go source tree
// LZ4 blocks decode at 2.8 GB/s on one core of the test machine where S2 blocks
// decode at 1.1 GB/s, for 2.4x compression against S2's 2.7x; zstd decodes slower
// still.

// CompressObject returns data as one LZ4 block, in dst if it is large enough, or nil
// when that would not be smaller than data.
func CompressObject(dst, data []byte) []byte {
	if len(data) < 64 || len(data) > maxCompressedObject {
		return nil
	}
	if n := lz4.CompressBlockBound(len(data)); cap(dst) < n {
		dst = make([]byte, n)
	}
	c := compressors.Get().(*lz4.Compressor)
	defer compressors.Put(c)
	n, err := c.CompressBlock(data, dst[:cap(dst)])
	if err != nil || n == 0 || n >= len(data) {
		return nil
	}
	return dst[:n]
}

var compressors = sync.Pool{New: func() any { return new(lz4.Compressor) }}

// DecompressObject decodes block, one LZ4 block of an object of size bytes (at most
// 64 MiB), into a new slice. Its bytes are not checked against any name.
func DecompressObject(block []byte, size int64) ([]byte, error) {
	if size > maxCompressedObject {
		return nil, fmt.Errorf("compressed object of %d bytes: larger than the %d allowed", size, maxCompressedObject)
	}
	return decodeObject(nil, block, size)
}

// decodeObject decodes block, which must be an object of size bytes, into dst (grown
// if needed) and returns the object's bytes.
func decodeObject(dst, block []byte, size int64) ([]byte, error) {
	if int64(cap(dst)) < size {
		dst = make([]byte, size)
	}
	dst = dst[:size]
	n, err := lz4.UncompressBlock(block, dst)
	switch {
	case err != nil:
		return nil, fmt.Errorf("compressed object: %w", err)
	case int64(n) != size:
		return nil, fmt.Errorf("compressed object decodes to %d bytes, not %d", n, size)
	}
	return dst, nil
}

// decodeBufs holds scratch buffers for decoding objects.
var decodeBufs sync.Pool

func getDecodeBuf() *[]byte {
	if b, ok := decodeBufs.Get().(*[]byte); ok {
		return b
	}
	return new([]byte)
}

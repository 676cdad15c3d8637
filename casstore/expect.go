package casstore

import (
	"fmt"
	"io"
	"os"
)

// PutExpect streams r into a staged object that must be named want. The bytes are
// hashed as they are written, and if they hash to anything else the temp file is
// removed and a *CorruptError is returned: a transfer from an untrusted source (a
// remote, a peer) is refused before anything is staged, not even under its true name.
// It returns the number of bytes read.
func (b *Batch) PutExpect(r io.Reader, want Hash) (int64, error) {
	f, err := b.createTemp()
	if err != nil {
		return 0, err
	}
	got, n, err := copyHashing(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return n, fmt.Errorf("write object %s: %w", want, err)
	}
	if got != want {
		os.Remove(f.Name())
		return n, &CorruptError{Hash: want, Got: got, Path: "transfer"}
	}
	if b.have(want) {
		os.Remove(f.Name())
		return n, nil
	}
	b.stage(want, f.Name(), n)
	return n, nil
}

// PutBytesExpect stages data after checking that it hashes to want.
func (b *Batch) PutBytesExpect(data []byte, want Hash) error {
	if got := Sum(data); got != want {
		return &CorruptError{Hash: want, Got: got, Path: "transfer"}
	}
	return b.putBytes(want, data) // hashed once: the check above is the hash
}

package remote

import (
	"bytes"
	"fmt"
	"hash"
	"io"

	"github.com/tidepool-dev/tidepool/casstore"
)

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// verifyingReader hashes an object's bytes as they pass and turns the final io.EOF
// into a *casstore.CorruptError when they do not hash to the object's name, so a
// consumer that stops at the first error never takes a wrong object for a whole one.
type verifyingReader struct {
	rc   io.ReadCloser
	want casstore.Hash
	size int64
	n    int64
	h    hash.Hash
	r    *Remote
	err  error
}

func newVerifyingReader(rc io.ReadCloser, want casstore.Hash, size int64, r *Remote) *verifyingReader {
	return &verifyingReader{rc: rc, want: want, size: size, h: casstore.NewHasher(), r: r}
}

func (v *verifyingReader) Read(p []byte) (int, error) {
	if v.err != nil {
		return 0, v.err
	}
	n, err := v.rc.Read(p)
	v.h.Write(p[:n])
	v.n += int64(n)
	if err == io.EOF {
		var got casstore.Hash
		v.h.Sum(got[:0])
		if got != v.want {
			v.r.metrics.verifyFailures.Add(1)
			v.err = fmt.Errorf("remote %s: refused object %s: %w", v.r.loc.url, v.want,
				&casstore.CorruptError{Hash: v.want, Got: got, Path: v.r.BlobKey(v.want)})
			return n, v.err
		}
		v.r.metrics.objectsFetched.Add(1)
		v.r.metrics.bytesFetched.Add(v.n)
		v.err = io.EOF
	} else if err != nil {
		v.err = fmt.Errorf("remote %s: read %s: %w", v.r.loc.url, v.r.BlobKey(v.want), err)
		return n, v.err
	}
	return n, v.err
}

func (v *verifyingReader) Close() error { return v.rc.Close() }

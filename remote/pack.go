package remote

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/containerd/log"
	"github.com/minio/minio-go/v7"

	"github.com/tidepool-dev/tidepool/casstore"
)

// A pack is one object beside LunarFS's layout, PREFIX/packs/<root hex>, holding
// exactly the objects one push of that root uploaded, so that a pull fetches a whole
// root with one streaming GET instead of one GET per object (per-object GETs of ~10 KB
// objects cap a pull at a few thousand objects a second). It changes nothing in the
// layout: every object is still uploaded to blobs/, refs are unchanged, and a LunarFS
// server ignores the extra keys. Packs are only a hint: every entry is verified
// before it is stored, and a pack that is missing, corrupt or truncated makes the
// pull fetch the rest object by object.
//
// Format, version 1 (integers big-endian):
//
//	magic   "TIDEPACK"       8 bytes
//	version uint32           1
//	flags   uint32           0 (a reader refuses any other value)
//	root    [32]byte         the root the push uploaded
//	base    [32]byte         the root it was diffed against, complete in the bucket
//	                         before the push (all zero: none); its pack, if any, holds
//	                         much of what this one left out
//	count   uint64           number of entries
//	count × entry:
//	  hash   [32]byte        BLAKE3-256 of the bytes (the object's name)
//	  length uint64
//	  bytes  [length]byte
//
// Entries come parents first (a tree before what it names, in a depth-first walk
// from root), so a reader that follows a root through the pack learns that it needs
// an object before the object arrives.
const (
	packMagic   = "TIDEPACK"
	packVersion = 1
	packHeader  = 8 + 4 + 4 + 32 + 32 + 8
	packEntry   = 32 + 8
	// maxPackChain bounds how many base packs one pull follows.
	maxPackChain = 8
)

// PackKey is where the pack of root lives in the bucket: PREFIX/packs/<root hex>.
func (r *Remote) PackKey(root casstore.Hash) string { return r.loc.prefix + PackPath(root) }

// PackPath is a pack's key below the prefix.
func PackPath(root casstore.Hash) string { return "packs/" + root.String() }

type packHead struct {
	root, base casstore.Hash
	count      uint64
}

func (h packHead) encode() []byte {
	b := make([]byte, 0, packHeader)
	b = append(b, packMagic...)
	b = binary.BigEndian.AppendUint32(b, packVersion)
	b = binary.BigEndian.AppendUint32(b, 0)
	b = append(b, h.root[:]...)
	b = append(b, h.base[:]...)
	return binary.BigEndian.AppendUint64(b, h.count)
}

// errBadPack marks a pack that cannot be read on (bad header, bad framing, short).
var errBadPack = errors.New("bad pack")

func decodePackHead(b []byte, size int64, want casstore.Hash) (packHead, error) {
	var h packHead
	switch {
	case len(b) < packHeader:
		return h, fmt.Errorf("%w: short header", errBadPack)
	case string(b[:8]) != packMagic:
		return h, fmt.Errorf("%w: not a pack (magic %q)", errBadPack, b[:8])
	case binary.BigEndian.Uint32(b[8:]) != packVersion:
		return h, fmt.Errorf("%w: format version %d, want %d", errBadPack, binary.BigEndian.Uint32(b[8:]), packVersion)
	case binary.BigEndian.Uint32(b[12:]) != 0:
		return h, fmt.Errorf("%w: unknown flags %#x", errBadPack, binary.BigEndian.Uint32(b[12:]))
	}
	copy(h.root[:], b[16:48])
	copy(h.base[:], b[48:80])
	h.count = binary.BigEndian.Uint64(b[80:])
	if h.root != want {
		return h, fmt.Errorf("%w: header names root %s", errBadPack, h.root)
	}
	if h.count > uint64(size-packHeader)/packEntry {
		return h, fmt.Errorf("%w: %d entries cannot fit in %d bytes", errBadPack, h.count, size)
	}
	return h, nil
}

// writePack uploads the pack of root: objs (what the push uploaded) in the order
// they appear walking root parents first. It streams from the store; nothing is
// buffered beyond the client's part size.
func (r *Remote) writePack(ctx context.Context, store *casstore.Store, root, base casstore.Hash, objs map[casstore.Hash]bool) error {
	order := make([]casstore.Hash, 0, len(objs))
	emitted := make(map[casstore.Hash]bool, len(objs))
	var walk func(h casstore.Hash) error
	walk = func(h casstore.Hash) error {
		emitted[h] = true
		order = append(order, h)
		t, err := store.ReadTree(h)
		if err != nil {
			return err
		}
		for _, e := range t {
			if emitted[e.Hash] {
				continue
			}
			if isTree, up := objs[e.Hash]; !up {
				continue // in the bucket before this push, and so is its subtree
			} else if isTree && e.Mode.IsDir() {
				if err := walk(e.Hash); err != nil {
					return err
				}
				continue
			}
			emitted[e.Hash] = true
			order = append(order, e.Hash)
		}
		return nil
	}
	if objs[root] && root != casstore.EmptyHash {
		if err := walk(root); err != nil {
			return err
		}
	}
	for h := range objs { // anything the walk could not place (none expected)
		if !emitted[h] {
			order = append(order, h)
		}
	}
	size := int64(packHeader)
	for _, h := range order {
		n, err := store.Size(h)
		if err != nil {
			return err
		}
		size += packEntry + n
	}
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(streamPack(pw, store, packHead{root: root, base: base, count: uint64(len(order))}, order))
	}()
	defer pr.Close()
	start := time.Now()
	key := r.PackKey(root)
	_, err := r.core.Client.PutObject(ctx, r.loc.bucket, key, pr, size, minio.PutObjectOptions{
		ContentType:      "application/octet-stream",
		DisableMultipart: size < 64<<20,
		PartSize:         16 << 20,
	})
	err = r.wrap("PUT", key, err)
	r.observe("put_pack", start, err)
	if err == nil {
		r.metrics.packsPushed.Add(1)
	}
	return err
}

func streamPack(w io.Writer, store *casstore.Store, head packHead, order []casstore.Hash) error {
	bw := bufio.NewWriterSize(w, 256<<10)
	if _, err := bw.Write(head.encode()); err != nil {
		return err
	}
	var ent [packEntry]byte
	for _, h := range order {
		f, err := store.Open(h) // verified: a corrupt local object is never packed
		if err != nil {
			return err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return err
		}
		copy(ent[:32], h[:])
		binary.BigEndian.PutUint64(ent[32:], uint64(st.Size()))
		if _, err := bw.Write(ent[:]); err != nil {
			f.Close()
			return err
		}
		n, err := io.Copy(bw, f)
		f.Close()
		if err != nil {
			return err
		}
		if n != st.Size() {
			return fmt.Errorf("object %s changed size while it was packed", h)
		}
	}
	return bw.Flush()
}

// packReader reads a pack's entries in order from one streaming GET.
type packReader struct {
	r    *Remote
	key  string
	br   *bufio.Reader
	body io.Closer
	head packHead
	left uint64
	read int64
	size int64
}

// openPack GETs the pack of root. A missing pack is errdefs.ErrNotFound (a bucket
// written by LunarFS, or a root no push uploaded anything for).
func (r *Remote) openPack(ctx context.Context, root casstore.Hash) (*packReader, error) {
	start := time.Now()
	key := r.PackKey(root)
	body, info, _, err := r.core.GetObject(ctx, r.loc.bucket, key, minio.GetObjectOptions{})
	err = r.wrap("GET", key, err)
	r.observe("get_pack", start, err)
	if err != nil {
		return nil, err
	}
	pr := &packReader{r: r, key: key, br: bufio.NewReaderSize(body, 1<<20), body: body, size: info.Size}
	hb := make([]byte, packHeader)
	if _, err := io.ReadFull(pr.br, hb); err != nil {
		body.Close()
		return nil, fmt.Errorf("%w: header: %v", errBadPack, err)
	}
	pr.read = packHeader
	if pr.head, err = decodePackHead(hb, info.Size, root); err != nil {
		body.Close()
		return nil, err
	}
	pr.left = pr.head.count
	return pr, nil
}

func (p *packReader) Close() error { return p.body.Close() }

// next reads the next entry's header; ok is false after the last entry.
func (p *packReader) next() (h casstore.Hash, n int64, ok bool, err error) {
	if p.left == 0 {
		return h, 0, false, nil
	}
	var ent [packEntry]byte
	if _, err := io.ReadFull(p.br, ent[:]); err != nil {
		return h, 0, false, p.short(err)
	}
	p.read += packEntry
	copy(h[:], ent[:32])
	l := binary.BigEndian.Uint64(ent[32:])
	if l > uint64(p.size-p.read) {
		return h, 0, false, fmt.Errorf("%w: entry %s of %d bytes overruns the pack", errBadPack, h, l)
	}
	p.left--
	return h, int64(l), true, nil
}

// bytes reads an entry's n bytes into memory.
func (p *packReader) bytes(n int64) ([]byte, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(p.br, b); err != nil {
		return nil, p.short(err)
	}
	p.read += n
	return b, nil
}

// skip discards an entry's n bytes.
func (p *packReader) skip(n int64) error {
	d, err := p.br.Discard(int(n))
	p.read += int64(d)
	if err != nil {
		return p.short(err)
	}
	return nil
}

// stream returns a reader of an entry's n bytes; after it, check p.read.
func (p *packReader) stream(n int64) io.Reader {
	return &countReader{r: io.LimitReader(p.br, n), n: &p.read}
}

func (p *packReader) short(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: truncated after %d of %d bytes", errBadPack, p.read, p.size)
	}
	return fmt.Errorf("remote %s: read %s: %w", p.r.loc.url, p.key, err)
}

type countReader struct {
	r io.Reader
	n *int64
}

func (c *countReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	*c.n += int64(n)
	return n, err
}

// packFailed logs and counts a pack a pull could not use to its end; the pull goes on
// object by object.
func (r *Remote) packFailed(ctx context.Context, root casstore.Hash, err error) {
	r.metrics.packFailures.Add(1)
	log.G(ctx).WithFields(log.Fields{"remote": r.loc.url, "pack": r.PackKey(root)}).WithError(err).
		Warn("pack unusable; fetching the remaining objects one by one")
}

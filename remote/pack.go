package remote

import (
	"bufio"
	"bytes"
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
// Format, version 2 (integers big-endian):
//
//	magic   "TIDEPACK"       8 bytes
//	version uint32           2
//	flags   uint32           0 (a reader refuses any other value)
//	root    [32]byte         the root the push uploaded
//	base    [32]byte         the root it was diffed against, complete in the bucket
//	                         before the push (all zero: none); its pack, if any, holds
//	                         much of what this one left out
//	count   uint64           number of entries
//	count × entry:
//	  hash   [32]byte        BLAKE3-256 of the object's bytes (its name)
//	  size   uint64          the object's size
//	  stored uint64          the length of what follows: size for the object's bytes
//	                         as they are, less for one LZ4 block of them (an object
//	                         of at most bigEntry bytes that compresses; see
//	                         casstore.CompressObject)
//	  bytes  [stored]byte
//
// Version 1, which earlier pushes wrote and a pull still reads, has no stored field:
// every entry is its hash, its length and its bytes as they are. Compression exists
// for the pull's sake: a durable pull must write every byte it receives to disk
// before it returns, and on a virtual disk that syncs a few hundred MB/s that write,
// not the network, bounded the pull. A source tree compresses to well under half
// its size, and LZ4 blocks decode at several GB/s, so a pull moves and syncs less
// than half the bytes (it keeps the blocks as they came in its journal, see
// casstore.Object), still decoding and hashing every object before it is stored.
//
// Entries come parents first (a tree before what it names, in a depth-first walk
// from root), so a reader that follows a root through the pack learns that it needs
// an object before the object arrives.
const (
	packMagic   = "TIDEPACK"
	packVersion = 2
	packHeader  = 8 + 4 + 4 + 32 + 32 + 8
	packEntry   = 32 + 8 + 8
	packEntryV1 = 32 + 8
	// maxPackChain bounds how many base packs one pull follows.
	maxPackChain = 8
	// packInMemory is the size of objects below which a push builds its pack in
	// memory and uploads it with one PUT of known length; a bigger pack is streamed
	// in parts (its compressed length is not known in advance).
	packInMemory = 64 << 20
)

// PackKey is where the pack of root lives in the bucket: PREFIX/packs/<root hex>.
func (r *Remote) PackKey(root casstore.Hash) string { return r.loc.prefix + PackPath(root) }

// PackPath is a pack's key below the prefix.
func PackPath(root casstore.Hash) string { return "packs/" + root.String() }

type packHead struct {
	version    uint32
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

// entrySize is the size of an entry's header in this pack's version.
func (h packHead) entrySize() int {
	if h.version == 1 {
		return packEntryV1
	}
	return packEntry
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
	case binary.BigEndian.Uint32(b[8:]) != packVersion && binary.BigEndian.Uint32(b[8:]) != 1:
		return h, fmt.Errorf("%w: format version %d, want 1 or %d", errBadPack, binary.BigEndian.Uint32(b[8:]), packVersion)
	case binary.BigEndian.Uint32(b[12:]) != 0:
		return h, fmt.Errorf("%w: unknown flags %#x", errBadPack, binary.BigEndian.Uint32(b[12:]))
	}
	h.version = binary.BigEndian.Uint32(b[8:])
	copy(h.root[:], b[16:48])
	copy(h.base[:], b[48:80])
	h.count = binary.BigEndian.Uint64(b[80:])
	if h.root != want {
		return h, fmt.Errorf("%w: header names root %s", errBadPack, h.root)
	}
	if h.count > uint64(size-packHeader)/uint64(h.entrySize()) {
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
	var raw int64
	for _, h := range order {
		n, err := store.Size(h)
		if err != nil {
			return err
		}
		raw += n
	}
	head := packHead{root: root, base: base, count: uint64(len(order))}
	start := time.Now()
	key := r.PackKey(root)
	// The compressed length is known once the pack is written: a small pack is built
	// in memory and sent with one PUT; a big one streams in parts of 16 MiB.
	var body io.Reader
	size := int64(-1)
	if raw < packInMemory {
		var buf bytes.Buffer
		if err := streamPack(&buf, store, head, order); err != nil {
			return err
		}
		body, size = &buf, int64(buf.Len())
	} else {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(streamPack(pw, store, head, order)) }()
		defer pr.Close()
		body = pr
	}
	_, err := r.core.Client.PutObject(ctx, r.loc.bucket, key, body, size, minio.PutObjectOptions{
		ContentType:      "application/octet-stream",
		DisableMultipart: size >= 0,
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
	var data, block []byte
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
		size := st.Size()
		copy(ent[:32], h[:])
		binary.BigEndian.PutUint64(ent[32:], uint64(size))
		if size > bigEntry {
			// Raw, streamed: a pull streams it into its store the same way.
			binary.BigEndian.PutUint64(ent[40:], uint64(size))
			if _, err := bw.Write(ent[:]); err != nil {
				f.Close()
				return err
			}
			n, err := io.Copy(bw, f)
			f.Close()
			if err != nil {
				return err
			}
			if n != size {
				return fmt.Errorf("object %s changed size while it was packed", h)
			}
			continue
		}
		if int64(cap(data)) < size {
			data = make([]byte, size)
		}
		data = data[:size]
		_, err = io.ReadFull(f, data)
		f.Close()
		if err != nil {
			return fmt.Errorf("object %s: %w", h, err)
		}
		stored := data
		if c := casstore.CompressObject(block, data); c != nil {
			block, stored = c, c
		}
		binary.BigEndian.PutUint64(ent[40:], uint64(len(stored)))
		if _, err := bw.Write(ent[:]); err != nil {
			return err
		}
		if _, err := bw.Write(stored); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// packSlab is the size of the buffers a pack is read into: a pull reads the stream
// in large pieces straight from the connection into a slab, verifies and journals the
// entries where they lie, and hands the slab back once they are written. It holds
// any entry of at most bigEntry bytes.
const packSlab = 4 << 20

// slabPool hands out at most n slabs of packSlab bytes, each made when first needed.
type slabPool struct {
	free chan []byte
}

func newSlabPool(n int) *slabPool {
	sp := &slabPool{free: make(chan []byte, n)}
	for i := 0; i < n; i++ {
		sp.free <- nil
	}
	return sp
}

// get waits for a free slab.
func (sp *slabPool) get() []byte {
	if b := <-sp.free; b != nil {
		return b
	}
	return make([]byte, packSlab)
}

// put gives a slab back.
func (sp *slabPool) put(b []byte) { sp.free <- b }

// packReader reads a pack's entries in order from one streaming GET, into slabs
// (packSlab bytes) taken from slabs. An entry's bytes are returned where they lie in
// the current slab; when the reader needs room past the slab's end it continues in a
// fresh slab and hands the old one to retire, whose owner gives it back to slabs
// once nothing uses the entries it holds.
type packReader struct {
	r    *Remote
	key  string
	body io.ReadCloser
	head packHead
	left uint64
	read int64 // bytes of the pack consumed
	size int64

	slabs    *slabPool
	retire   func(slab []byte)
	buf      []byte // the current slab
	pos, end int    // consumed up to pos; read up to end
}

// openPack GETs the pack of root. A missing pack is errdefs.ErrNotFound (a bucket
// written by LunarFS, or a root no push uploaded anything for). Its slabs come from
// slabs and go back there once the reader moves on from them, unless the caller sets
// retire.
func (r *Remote) openPack(ctx context.Context, root casstore.Hash, slabs *slabPool) (*packReader, error) {
	start := time.Now()
	key := r.PackKey(root)
	body, info, _, err := r.core.GetObject(ctx, r.loc.bucket, key, minio.GetObjectOptions{})
	err = r.wrap("GET", key, err)
	r.observe("get_pack", start, err)
	if err != nil {
		return nil, err
	}
	pr := &packReader{r: r, key: key, body: body, size: info.Size, slabs: slabs, retire: slabs.put, buf: slabs.get()}
	if err := pr.ensure(packHeader); err != nil {
		pr.Close()
		return nil, fmt.Errorf("%w: header: %v", errBadPack, err)
	}
	hb := pr.take(packHeader)
	if pr.head, err = decodePackHead(hb, info.Size, root); err != nil {
		pr.Close()
		return nil, err
	}
	pr.left = pr.head.count
	return pr, nil
}

// Close ends the GET; the current slab goes to retire.
func (p *packReader) Close() error {
	if p.buf != nil {
		p.retire(p.buf)
		p.buf = nil
	}
	return p.body.Close()
}

// ensure makes the next k (at most packSlab) bytes readable in the current slab,
// moving to a fresh slab (the unconsumed bytes copied along) when they cannot fit.
func (p *packReader) ensure(k int) error {
	if p.end-p.pos >= k {
		return nil
	}
	if p.pos+k > len(p.buf) {
		fresh := p.slabs.get()
		p.end = copy(fresh, p.buf[p.pos:p.end])
		p.pos = 0
		old := p.buf
		p.buf = fresh
		p.retire(old)
	}
	n, err := io.ReadAtLeast(p.body, p.buf[p.end:], p.pos+k-p.end)
	p.end += n
	return err
}

// take consumes k bytes made readable by ensure.
func (p *packReader) take(k int) []byte {
	b := p.buf[p.pos : p.pos+k : p.pos+k]
	p.pos += k
	p.read += int64(k)
	return b
}

// next reads the next entry's header; ok is false after the last entry.
func (p *packReader) next() (e packEntryHead, ok bool, err error) {
	if p.left == 0 {
		return e, false, nil
	}
	es := p.head.entrySize()
	if err := p.ensure(es); err != nil {
		return e, false, p.short(err)
	}
	ent := p.take(es)
	copy(e.h[:], ent[:32])
	size := binary.BigEndian.Uint64(ent[32:])
	stored := size
	if es == packEntry {
		stored = binary.BigEndian.Uint64(ent[40:])
	}
	switch {
	case stored > uint64(p.size-p.read):
		return e, false, fmt.Errorf("%w: entry %s of %d bytes overruns the pack", errBadPack, e.h, stored)
	case stored > size:
		return e, false, fmt.Errorf("%w: entry %s stores %d bytes for an object of %d", errBadPack, e.h, stored, size)
	case stored < size && size > bigEntry:
		return e, false, fmt.Errorf("%w: entry %s holds an object of %d bytes compressed (at most %d allowed)", errBadPack, e.h, size, bigEntry)
	}
	p.left--
	return packEntryHead{h: e.h, size: int64(size), stored: int64(stored)}, true, nil
}

// packEntryHead is an entry's header: the object's name and size, and the length of
// the bytes that follow (less than size: one LZ4 block of the object).
type packEntryHead struct {
	h            casstore.Hash
	size, stored int64
}

func (e packEntryHead) compressed() bool { return e.stored < e.size }

// bytes returns an entry's n bytes (at most packSlab), where they lie in the current
// slab: valid until the slab is retired and given back.
func (p *packReader) bytes(n int64) ([]byte, error) {
	if err := p.ensure(int(n)); err != nil {
		return nil, p.short(err)
	}
	return p.take(int(n)), nil
}

// skip discards an entry's n bytes.
func (p *packReader) skip(n int64) error {
	for n > 0 {
		k := int(min(n, packSlab/2))
		if err := p.ensure(k); err != nil {
			return p.short(err)
		}
		p.take(k)
		n -= int64(k)
	}
	return nil
}

// stream returns a reader of an entry's n bytes: those already in the slab, then the
// rest straight from the connection; after it, check p.read.
func (p *packReader) stream(n int64) io.Reader {
	have := min(n, int64(p.end-p.pos))
	first := p.buf[p.pos : p.pos+int(have)]
	p.pos += int(have)
	return &countReader{r: io.MultiReader(bytesReader(first), io.LimitReader(p.body, n-have)), n: &p.read}
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

package kview

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"slices"
	"strings"
)

// This file lays out a scanned Tree as its metadata-only EROFS image, directly from
// the node tree, front to back. It writes exactly the bytes go-erofs (v0.3.1 with the
// patches in third_party/go-erofs) writes for the same tree through
// Writer.CopyFrom(tree, MetadataOnly()): the tests build both and compare them, so
// go-erofs stays the reference for the format while the build, which is on a
// container's create path, costs a few milliseconds instead of tens (go-erofs goes
// through fs.FS: a path string, a map entry and several allocations per inode).
//
// The layout (go-erofs's "data-first" one): block 0 holds the superblock at byte
// 1024; then the data blocks of directories and symlinks too big to sit inline in
// their inode's block, each padded to a block; then the metadata area, where the
// inode of NID n is at byte 32n. Inodes come in depth-first pre-order with the
// children of each directory sorted by name; the root is NID 1. Every inode is
// compact (32 bytes) unless its owner, link count or size needs the extended one
// (64 bytes); an inode's core never crosses a block. A regular file is chunk-based
// (8-byte indexes, one 4 KiB chunk each, every one null, i.e. all holes) with the
// overlay xattrs inline; an empty file has neither. A directory's entries (".", ".."
// and its children, sorted by name, packed into blocks) and a symlink's target sit
// inline after the inode when they fit in the rest of its block, else in data blocks.

const (
	erofsBlockBits   = 12
	erofsBlockSize   = 1 << erofsBlockBits
	erofsMagic       = 0xe0f5e1e2
	erofsSBOffset    = 1024
	erofsCompact     = 32
	erofsExtended    = 64
	erofsDirent      = 12
	erofsXattrHeader = 12
	erofsChunkIndex  = 8

	layoutFlatPlain  = 0
	layoutFlatInline = 2
	layoutChunkBased = 4

	chunkFormatIndexes = 0x20 // 8-byte chunk indexes; chunk bits 0: 4 KiB chunks

	ftypeReg     = 1
	ftypeDir     = 2
	ftypeSymlink = 7

	xattrIndexTrusted = 4 // the "trusted." prefix
)

// The inline xattrs of a non-empty file: trusted.overlay.metacopy (empty) and
// trusted.overlay.redirect (Redirect: "/" + 2 hex + "/" + 62 hex), names without
// their "trusted." prefix, in name order.
const (
	xattrTrusted        = "trusted."
	xattrMetacopySuffix = "overlay.metacopy"
	xattrRedirectSuffix = "overlay.redirect"
	redirectLen         = 1 + 2 + 1 + 62
	fileXattrSize       = erofsXattrHeader + (4+len(xattrMetacopySuffix)+3)&^3 + (4+len(xattrRedirectSuffix)+redirectLen+3)&^3
)

// inode is one entry of the image being laid out.
type inode struct {
	n        *node
	parent   int32 // index of the parent directory's inode (the root's own)
	nid      uint64
	mode     uint16 // unix mode with type bits
	uid, gid uint32
	nlink    uint32
	size     uint64 // i_size: a file's size, a directory's entry bytes, a target's length
	layout   uint8
	compact  bool
	xattr    int    // bytes of the inline xattr area
	chunkPad int    // bytes between the xattr area and the chunk indexes
	trailing int    // inline bytes after the xattrs: chunk indexes, entries or a target
	dataBlk  uint32 // first data block of a flat-plain directory or symlink
	dirFirst int32  // directories: first of their entries in imageLayout.names
}

// dirName is one entry of a directory: a child, or "." (dot) or ".." (dotdot).
type dirName int32

const (
	dot    dirName = -1
	dotdot dirName = -2
)

// imageLayout is the plan of one image.
type imageLayout struct {
	t     *Tree
	nodes []inode
	// names holds every directory's entries in on-disk order, each directory's from
	// its dirFirst on (count: children + 2): a child as the index of its inode.
	names    []dirName
	metaBlk  uint32 // first block of the metadata area
	metaSize int    // bytes of the metadata area before its last padding
	dataBlks uint32
}

// WriteImage writes the tree's metadata-only EROFS image to w, front to back in
// large writes. The same tree and spec always give the same bytes.
func (t *Tree) WriteImage(w io.Writer) error {
	_, err := t.writeImage(w, &scratch{})
	return err
}

// writeImage is WriteImage, returning the plan it wrote (for its owner slots), laid
// out in sc (scratch.go): the plan is valid as long as sc is not reset.
func (t *Tree) writeImage(w io.Writer, sc *scratch) (*imageLayout, error) {
	if n := t.Files + t.Dirs + t.symlinks + 1; cap(sc.inodes) < n {
		sc.inodes = make([]inode, 0, n)
	}
	if cap(sc.buf) < imageWriteBuffer {
		sc.buf = make([]byte, 0, imageWriteBuffer)
	}
	l := &imageLayout{t: t, nodes: sc.inodes[:0], names: sc.names[:0]}
	err := l.collect(t.top, 0)
	sc.inodes, sc.names = l.nodes, l.names // keeps what append grew
	if err != nil {
		return nil, err
	}
	l.plan()
	iw := &imageWriter{w: w, buf: sc.buf[:0]}
	l.write(iw)
	if err := iw.flush(); err != nil {
		return nil, fmt.Errorf("write image: %w", err)
	}
	return l, nil
}

// imageBytes is the image in memory (tests).
func (t *Tree) imageBytes() ([]byte, error) {
	var b bytes.Buffer
	err := t.WriteImage(&b)
	return b.Bytes(), err
}

// collect appends n and everything under it, depth first, children in name order.
func (l *imageLayout) collect(n *node, parent int32) error {
	i := int32(len(l.nodes))
	in := inode{n: n, parent: parent, nlink: 1}
	if n.owned {
		in.uid, in.gid = l.t.spec.UID, l.t.spec.GID
	}
	switch {
	case n.mode.IsDir():
		in.mode = 0o040000 | uint16(n.mode.Perm())
		in.nlink = 2 + uint32(n.subdirs)
	case n.mode&fs.ModeSymlink != 0:
		in.mode = 0o120000 | uint16(n.mode.Perm())
		in.size = uint64(len(n.target))
	case n.mode.IsRegular():
		in.mode = 0o100000 | uint16(n.mode.Perm())
		in.size = uint64(n.size)
	default:
		return fmt.Errorf("build image: %s: unsupported mode %v", n.name, n.mode)
	}
	l.nodes = append(l.nodes, in)
	if !n.mode.IsDir() {
		return nil
	}
	children := n.children
	if !slices.IsSortedFunc(children, byName) {
		children = slices.SortedFunc(slices.Values(children), byName)
	}
	// The entries are laid out once every child has its inode index: remember where
	// this directory's children start, then recurse.
	idx := make([]int32, len(children))
	for k, c := range children {
		idx[k] = int32(len(l.nodes))
		if err := l.collect(c, i); err != nil {
			return err
		}
	}
	l.nodes[i].dirFirst = int32(len(l.names))
	// ".", ".." and the children, merged in name order ("." sorts before "..").
	dots := [2]struct {
		name string
		d    dirName
	}{{".", dot}, {"..", dotdot}}
	di := 0
	for k, c := range children {
		for di < 2 && dots[di].name < c.name {
			l.names = append(l.names, dots[di].d)
			di++
		}
		l.names = append(l.names, dirName(idx[k]))
	}
	for ; di < 2; di++ {
		l.names = append(l.names, dots[di].d)
	}
	return nil
}

func byName(a, b *node) int { return strings.Compare(a.name, b.name) }

// entries returns directory i's entries in on-disk order.
func (l *imageLayout) entries(i int) []dirName {
	d := &l.nodes[i]
	return l.names[d.dirFirst : int(d.dirFirst)+len(d.n.children)+2]
}

// name is an entry's name.
func (l *imageLayout) name(d dirName) string {
	switch d {
	case dot:
		return "."
	case dotdot:
		return ".."
	}
	return l.nodes[d].n.name
}

// direntBytes is the size of directory i's entry data: blocks of headers then names,
// every block but the last padded to the block size.
func (l *imageLayout) direntBytes(i int) int {
	total := 0
	ents := l.entries(i)
	for k := 0; k < len(ents); {
		used, next := l.direntBlock(ents, k)
		if next < len(ents) {
			used = erofsBlockSize
		}
		total += used
		k = next
	}
	return total
}

// direntBlock packs entries from k on into one block and returns the bytes used and
// the first entry of the next block.
func (l *imageLayout) direntBlock(ents []dirName, k int) (used, next int) {
	names := 0
	for j := k; j < len(ents); j++ {
		names += len(l.name(ents[j]))
		need := (j-k+1)*erofsDirent + names
		if need > erofsBlockSize {
			break
		}
		used, next = need, j+1
	}
	if next == k { // a single entry larger than a block (names are at most 255 bytes)
		return erofsDirent + len(l.name(ents[k])), k + 1
	}
	return used, next
}

func round32(n int) int { return (n + 31) &^ 31 }

// plan assigns NIDs, layouts and data blocks, as go-erofs's planLayout and
// assignDataBlocks do.
func (l *imageLayout) plan() {
	cur := 32 // NID 0 stays unused: the root's st_ino would be 0
	for i := range l.nodes {
		e := &l.nodes[i]
		e.nid = uint64(cur / 32)
		if e.mode&0o170000 == 0o100000 && e.size > 0 {
			e.xattr = fileXattrSize
		}
		e.compact = e.uid <= 0xffff && e.gid <= 0xffff && e.nlink <= 0xffff && e.size <= 0xffffffff
		core := erofsExtended
		if e.compact {
			core = erofsCompact
		}
		header := core + e.xattr
		inlineFits := func(n int) bool {
			in := (cur + header) % erofsBlockSize
			return n > 0 && in+n <= erofsBlockSize
		}
		switch e.mode & 0o170000 {
		case 0o100000:
			e.layout = layoutChunkBased
		case 0o040000:
			e.size = uint64(l.direntBytes(i))
			e.layout = layoutFlatPlain
			if inlineFits(int(e.size)) {
				e.layout = layoutFlatInline
			}
		case 0o120000:
			e.layout = layoutFlatPlain
			if inlineFits(int(e.size)) {
				e.layout = layoutFlatInline
			}
		}
		e.setTrailing()
		if cur%erofsBlockSize+core > erofsBlockSize {
			cur = (cur + erofsBlockSize - 1) &^ (erofsBlockSize - 1)
			e.nid = uint64(cur / 32)
		}
		if e.layout == layoutFlatInline && cur%erofsBlockSize+header+e.trailing > erofsBlockSize {
			e.layout = layoutFlatPlain
			e.setTrailing()
		}
		cur += round32(header + e.chunkPad + e.trailing)
	}
	l.metaSize = cur
	blk := uint32(1) // block 0: the superblock
	for i := range l.nodes {
		e := &l.nodes[i]
		if e.layout == layoutFlatPlain && e.mode&0o170000 != 0o100000 && e.size > 0 {
			e.dataBlk = blk
			blk += uint32((e.size + erofsBlockSize - 1) / erofsBlockSize)
		}
	}
	l.dataBlks = blk - 1
	l.metaBlk = blk
}

// setTrailing sizes what follows an inode's xattrs for its layout.
func (e *inode) setTrailing() {
	e.trailing, e.chunkPad = 0, 0
	switch {
	case e.layout == layoutChunkBased:
		if e.size > 0 {
			e.trailing = int((e.size+erofsBlockSize-1)/erofsBlockSize) * erofsChunkIndex
			core := erofsExtended
			if e.compact {
				core = erofsCompact
			}
			if r := (core + e.xattr) % erofsChunkIndex; r != 0 {
				e.chunkPad = erofsChunkIndex - r
			}
		}
	case e.layout == layoutFlatInline:
		e.trailing = int(e.size)
	}
}

// imageWriteBuffer is how much of the image WriteImage holds before writing it out.
const imageWriteBuffer = 256 << 10

// imageWriter writes an image front to back through a buffer; the first error sticks.
type imageWriter struct {
	w   io.Writer
	buf []byte
	off int64 // bytes of the image laid out so far
	err error
}

// next returns the image's next n bytes (at most imageWriteBuffer), zeroed, to fill.
func (w *imageWriter) next(n int) []byte {
	if len(w.buf)+n > cap(w.buf) {
		w.flushBuf()
	}
	start := len(w.buf)
	w.buf = w.buf[:start+n]
	clear(w.buf[start:])
	w.off += int64(n)
	return w.buf[start:]
}

// padTo adds zeros up to offset off.
func (w *imageWriter) padTo(off int64) {
	for w.off < off {
		w.next(int(min(off-w.off, imageWriteBuffer)))
	}
}

func (w *imageWriter) flushBuf() {
	if len(w.buf) > 0 && w.err == nil {
		_, w.err = w.w.Write(w.buf)
	}
	w.buf = w.buf[:0]
}

func (w *imageWriter) flush() error {
	w.flushBuf()
	return w.err
}

// write lays every byte out, in order: the superblock's block, the data blocks, the
// metadata area (inodes in NID order, which is the order of l.nodes).
func (l *imageLayout) write(w *imageWriter) {
	le := binary.LittleEndian
	metaBlks := (l.metaSize + erofsBlockSize - 1) / erofsBlockSize
	sb := w.next(erofsBlockSize)[erofsSBOffset:]
	le.PutUint32(sb[0:], erofsMagic)
	sb[12] = erofsBlockBits
	le.PutUint16(sb[14:], uint16(l.nodes[0].nid))
	le.PutUint64(sb[16:], uint64(len(l.nodes)))
	le.PutUint64(sb[24:], Mtime)
	le.PutUint32(sb[36:], uint32(1+int(l.dataBlks)+metaBlks))
	le.PutUint32(sb[40:], l.metaBlk)
	for i := range l.nodes {
		e := &l.nodes[i]
		if e.dataBlk == 0 {
			continue
		}
		w.padTo(int64(e.dataBlk) * erofsBlockSize)
		if e.mode&0o170000 == 0o040000 {
			l.writeDirents(w, i)
		} else {
			copy(w.next(len(e.n.target)), e.n.target)
		}
	}
	meta := int64(l.metaBlk) * erofsBlockSize
	for i := range l.nodes {
		e := &l.nodes[i]
		w.padTo(meta + int64(e.nid)*32)
		var inodeData uint32
		switch {
		case e.layout == layoutChunkBased:
			inodeData = chunkFormatIndexes
		case e.layout == layoutFlatPlain:
			inodeData = e.dataBlk
		}
		xcount := uint16(0)
		if e.xattr > 0 {
			xcount = uint16((e.xattr-erofsXattrHeader)/4) + 1
		}
		if e.compact {
			ib := w.next(erofsCompact)
			le.PutUint16(ib[0:], uint16(e.layout)<<1)
			le.PutUint16(ib[2:], xcount)
			le.PutUint16(ib[4:], e.mode)
			le.PutUint16(ib[6:], uint16(e.nlink))
			le.PutUint32(ib[8:], uint32(e.size))
			le.PutUint32(ib[16:], inodeData)
			le.PutUint16(ib[24:], uint16(e.uid))
			le.PutUint16(ib[26:], uint16(e.gid))
		} else {
			ib := w.next(erofsExtended)
			le.PutUint16(ib[0:], uint16(e.layout)<<1|1)
			le.PutUint16(ib[2:], xcount)
			le.PutUint16(ib[4:], e.mode)
			le.PutUint64(ib[8:], e.size)
			le.PutUint32(ib[16:], inodeData)
			le.PutUint32(ib[24:], e.uid)
			le.PutUint32(ib[28:], e.gid)
			le.PutUint64(ib[32:], Mtime)
			le.PutUint32(ib[44:], e.nlink)
		}
		if e.xattr > 0 {
			writeFileXattrs(w.next(e.xattr), e.n)
		}
		w.next(e.chunkPad)
		switch {
		case e.layout == layoutChunkBased:
			for left := e.trailing; left > 0; {
				n := min(left, imageWriteBuffer) // both multiples of erofsChunkIndex
				fillNullChunks(w.next(n))
				left -= n
			}
		case e.layout == layoutFlatInline && e.mode&0o170000 == 0o040000:
			l.writeDirents(w, i)
		case e.layout == layoutFlatInline:
			copy(w.next(len(e.n.target)), e.n.target)
		}
	}
	w.padTo(meta + int64(metaBlks)*erofsBlockSize)
}

// fillNullChunks fills b (a whole number of chunk indexes) with null chunk indexes:
// no device, block address all ones (a hole).
func fillNullChunks(b []byte) {
	if len(b) == 0 {
		return
	}
	binary.LittleEndian.PutUint16(b[0:], 0xffff)
	binary.LittleEndian.PutUint32(b[4:], 0xffffffff)
	for done := erofsChunkIndex; done < len(b); done *= 2 {
		copy(b[done:], b[:done])
	}
}

// writeFileXattrs writes a non-empty file's xattr area (fileXattrSize bytes) at b.
func writeFileXattrs(b []byte, n *node) {
	le := binary.LittleEndian
	le.PutUint32(b, 0xffffffff) // name filter: unused
	p := erofsXattrHeader
	b[p], b[p+1] = byte(len(xattrMetacopySuffix)), xattrIndexTrusted
	p += 4
	p += copy(b[p:], xattrMetacopySuffix)
	p = (p + 3) &^ 3
	b[p], b[p+1] = byte(len(xattrRedirectSuffix)), xattrIndexTrusted
	le.PutUint16(b[p+2:], redirectLen)
	p += 4
	p += copy(b[p:], xattrRedirectSuffix)
	// Redirect(n.hash), without the string.
	b[p] = '/'
	hex.Encode(b[p+1:p+3], n.hash[:1])
	b[p+3] = '/'
	hex.Encode(b[p+4:p+redirectLen], n.hash[1:])
}

// writeDirents writes directory i's entries: blocks of headers then names, every
// block but the last padded to the block size.
func (l *imageLayout) writeDirents(w *imageWriter, i int) {
	le := binary.LittleEndian
	ents := l.entries(i)
	for k := 0; k < len(ents); {
		used, next := l.direntBlock(ents, k)
		size := used
		if next < len(ents) {
			size = erofsBlockSize
		}
		b := w.next(size)
		nameOff := (next - k) * erofsDirent
		for j := k; j < next; j++ {
			var nid uint64
			ftype := byte(ftypeDir)
			switch d := ents[j]; d {
			case dot:
				nid = l.nodes[i].nid
			case dotdot:
				nid = l.nodes[l.nodes[i].parent].nid
			default:
				c := &l.nodes[d]
				nid = c.nid
				switch c.mode & 0o170000 {
				case 0o100000:
					ftype = ftypeReg
				case 0o120000:
					ftype = ftypeSymlink
				}
			}
			h := b[(j-k)*erofsDirent:]
			le.PutUint64(h[0:], nid)
			le.PutUint16(h[8:], uint16(nameOff))
			h[10] = ftype
			nameOff += copy(b[nameOff:], l.name(ents[j]))
		}
		k = next
	}
}

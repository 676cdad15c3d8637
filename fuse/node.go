package fuse

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	gofs "github.com/hanwen/go-fuse/v2/fs"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// dirNode is a directory of a view: either synthesized (the view root and the parent
// directories of a prefix, owned by 0:0) or a tree object (owned by the view's owner),
// decoded on first lookup or listing and kept while the kernel remembers the inode.
type dirNode struct {
	gofs.Inode
	v    *View
	path string // relative to the view root; "" for the root
	root bool
	// depth >= 0 marks a synthesized directory holding prefix component comps[depth];
	// -1 marks a tree directory.
	depth int
	// hash is the tree object; zero for the root of an unprefixed view, whose tree
	// is whatever the view is bound to.
	hash casstore.Hash

	mu   sync.Mutex
	tree casstore.Tree
	have bool
}

var (
	_ gofs.NodeLookuper       = (*dirNode)(nil)
	_ gofs.NodeGetattrer      = (*dirNode)(nil)
	_ gofs.NodeOpendirHandler = (*dirNode)(nil)
	_ gofs.NodeStatfser       = (*dirNode)(nil)
)

func (d *dirNode) synthetic() bool { return d.depth >= 0 }

// child describes one entry of a directory before it becomes an inode.
type child struct {
	name  string
	mode  casstore.Mode
	hash  casstore.Hash
	depth int // for a synthesized child directory; -1 otherwise
}

// treeHash returns the tree this directory lists, or false if it is the root of an
// unbound view (which lists nothing). taint says whether asking counts as a look at
// the view before binding.
func (d *dirNode) treeHash(taint bool) (casstore.Hash, bool) {
	if !d.root {
		return d.hash, true
	}
	return d.v.bound(taint)
}

// loadTree decodes this directory's tree once (hydrating it if needed); concurrent
// first lookups may decode it twice, which is harmless. Failures are not cached: a
// later lookup retries.
func (d *dirNode) loadTree(ctx context.Context, h casstore.Hash) (casstore.Tree, syscall.Errno) {
	d.mu.Lock()
	t, have := d.tree, d.have
	d.mu.Unlock()
	if have {
		return t, 0
	}
	t, err := d.v.readTree(ctx, h)
	if err != nil {
		return nil, d.v.fail(err, ErrTree, d.path, h, "cannot read directory")
	}
	if l := d.v.opts.Limits.WithDefaults(); int64(len(t)) > l.MaxEntries {
		err := fmt.Errorf("directory has %d entries, more than %d (max_tree_entries): %w", len(t), l.MaxEntries, casstore.ErrTreeLimit)
		return nil, d.v.fail(err, ErrTree, d.path, h, "refused directory")
	}
	d.mu.Lock()
	d.tree, d.have = t, true
	d.mu.Unlock()
	return t, 0
}

// entries lists the directory.
func (d *dirNode) entries(ctx context.Context) ([]child, syscall.Errno) {
	if d.synthetic() {
		root, ok := d.v.bound(d.root)
		if !ok {
			return nil, 0
		}
		return []child{d.synthChild(root)}, 0
	}
	h, ok := d.treeHash(true)
	if !ok {
		return nil, 0
	}
	t, errno := d.loadTree(ctx, h)
	if errno != 0 {
		return nil, errno
	}
	out := make([]child, len(t))
	for i, e := range t {
		out[i] = child{name: e.Name, mode: e.Mode, hash: e.Hash, depth: -1}
	}
	return out, 0
}

// synthChild is the single entry of a synthesized directory: the next prefix
// component, which is either another synthesized directory or the tree root.
func (d *dirNode) synthChild(root casstore.Hash) child {
	c := child{name: d.v.comps[d.depth], mode: casstore.ModeDir, depth: -1}
	if d.depth+1 < len(d.v.comps) {
		c.depth = d.depth + 1
	} else {
		c.hash = root
	}
	return c
}

// find looks up one name.
func (d *dirNode) find(ctx context.Context, name string) (child, syscall.Errno) {
	if d.synthetic() {
		// At the root of an unbound view only the prefix's first component counts as
		// a look at the workdir; lookups of the image's other top-level names do not.
		root, ok := d.v.bound(d.root && name == d.v.comps[d.depth])
		if !ok || name != d.v.comps[d.depth] {
			return child{}, syscall.ENOENT
		}
		return d.synthChild(root), 0
	}
	h, ok := d.treeHash(true)
	if !ok {
		return child{}, syscall.ENOENT
	}
	t, errno := d.loadTree(ctx, h)
	if errno != 0 {
		return child{}, errno
	}
	e, ok := t.Lookup(name)
	if !ok {
		return child{}, syscall.ENOENT
	}
	return child{name: e.Name, mode: e.Mode, hash: e.Hash, depth: -1}, 0
}

// Lookup implements gofs.NodeLookuper.
func (d *dirNode) Lookup(ctx context.Context, name string, out *gofuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	d.v.stats.Lookups.Add(1)
	c, errno := d.find(ctx, name)
	if errno != 0 {
		return nil, errno
	}
	p := name
	if d.path != "" {
		p = d.path + "/" + name
	}
	if c.mode == casstore.ModeDir {
		if l := d.v.opts.Limits.WithDefaults(); strings.Count(p, "/")+1 > l.MaxDepth {
			err := fmt.Errorf("directories nested deeper than %d (max_tree_depth): %w", l.MaxDepth, casstore.ErrTreeLimit)
			return nil, d.v.fail(err, ErrTree, p, c.hash, "refused directory")
		}
	}
	ino := d.v.inos.ino(p)
	var node gofs.InodeEmbedder
	var typ uint32
	switch c.mode {
	case casstore.ModeDir:
		node, typ = &dirNode{v: d.v, path: p, depth: c.depth, hash: c.hash}, syscall.S_IFDIR
	case casstore.ModeSymlink:
		node, typ = &linkNode{blobNode{v: d.v, path: p, hash: c.hash}}, syscall.S_IFLNK
	case casstore.ModeExec:
		node, typ = &fileNode{blobNode: blobNode{v: d.v, path: p, hash: c.hash}, exec: true}, syscall.S_IFREG
	default:
		node, typ = &fileNode{blobNode: blobNode{v: d.v, path: p, hash: c.hash}}, syscall.S_IFREG
	}
	var ao gofuse.AttrOut
	if errno := node.(gofs.NodeGetattrer).Getattr(ctx, nil, &ao); errno != 0 {
		return nil, errno
	}
	out.Attr = ao.Attr
	if t := ao.Timeout(); t != 0 {
		out.SetAttrTimeout(t)
	}
	return d.NewInode(ctx, node, gofs.StableAttr{Mode: typ, Ino: ino}), 0
}

// Getattr implements gofs.NodeGetattrer.
func (d *dirNode) Getattr(ctx context.Context, _ gofs.FileHandle, out *gofuse.AttrOut) syscall.Errno {
	owned := !d.synthetic()
	ino := uint64(rootIno)
	if !d.root {
		ino = d.v.inos.ino(d.path)
	}
	d.v.fillAttr(&out.Attr, ino, syscall.S_IFDIR|0o755, owned, 0, 0, 0)
	return 0
}

// OpendirHandle implements gofs.NodeOpendirHandler. It checks the directory can be
// listed, but builds the listing only when the kernel reads it: tree directories
// never change, so the kernel caches their listings and later opendirs read nothing.
// The root and synthesized directories change once, at Bind, so theirs are not
// cached. Opening the root of an unbound view is not a look at the workdir (containerd
// opens every lower directory of a rootfs to read /etc/group, say); reading its
// listing is, and is recorded when it happens.
func (d *dirNode) OpendirHandle(ctx context.Context, _ uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if d.root {
		if _, bound := d.v.bound(false); !bound {
			return &dirHandle{d: d, lazy: true}, 0, 0
		}
	}
	var ents []child
	if d.synthetic() || d.root {
		var errno syscall.Errno
		if ents, errno = d.entries(ctx); errno != 0 {
			return nil, 0, errno
		}
		return &dirHandle{d: d, ents: ents}, 0, 0
	}
	if _, errno := d.loadTree(ctx, d.hash); errno != 0 {
		return nil, 0, errno
	}
	return &dirHandle{d: d, lazy: true}, gofuse.FOPEN_CACHE_DIR | gofuse.FOPEN_KEEP_CACHE, 0
}

// listing renders the directory's entries with their inode numbers.
func (d *dirNode) listing(ents []child) []gofuse.DirEntry {
	d.v.stats.Readdirs.Add(1)
	self := uint64(rootIno)
	parent := uint64(rootIno)
	if !d.root {
		self = d.v.inos.ino(d.path)
		if dir := path.Dir(d.path); dir != "." {
			parent = d.v.inos.ino(dir)
		}
	}
	list := make([]gofuse.DirEntry, 0, len(ents)+2)
	list = append(list,
		gofuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: self},
		gofuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: parent})
	for _, c := range ents {
		p := c.name
		if d.path != "" {
			p = d.path + "/" + c.name
		}
		list = append(list, gofuse.DirEntry{Name: c.name, Mode: typeOf(c.mode), Ino: d.v.inos.ino(p)})
	}
	for i := range list {
		list[i].Off = uint64(i + 1)
	}
	return list
}

// Statfs implements gofs.NodeStatfser.
func (d *dirNode) Statfs(_ context.Context, out *gofuse.StatfsOut) syscall.Errno {
	statfs(out)
	return 0
}

// Statfs implements gofs.NodeStatfser.
func (b *blobNode) Statfs(_ context.Context, out *gofuse.StatfsOut) syscall.Errno {
	statfs(out)
	return 0
}

// statfs reports no space (the view is read-only) but the limits programs ask
// pathconf for, which would otherwise read as zero.
func statfs(out *gofuse.StatfsOut) {
	*out = gofuse.StatfsOut{Bsize: 4096, Frsize: 4096, NameLen: 255}
}

func typeOf(m casstore.Mode) uint32 {
	switch m {
	case casstore.ModeDir:
		return syscall.S_IFDIR
	case casstore.ModeSymlink:
		return syscall.S_IFLNK
	}
	return syscall.S_IFREG
}

// dirHandle serves one snapshot of a listing; offsets are 1-based positions. ents is
// the snapshot taken at opendir (root, synthesized directories), or nil with lazy
// set for tree directories, whose entries are read at the first READDIR.
type dirHandle struct {
	d    *dirNode
	mu   sync.Mutex
	ents []child
	lazy bool
	list []gofuse.DirEntry
	done bool // list is built
	pos  int
}

var (
	_ gofs.FileReaddirenter = (*dirHandle)(nil)
	_ gofs.FileSeekdirer    = (*dirHandle)(nil)
	_ gofs.FileReleasedirer = (*dirHandle)(nil)
)

// build renders the listing once; the caller holds h.mu.
func (h *dirHandle) build(ctx context.Context) syscall.Errno {
	if h.done {
		return 0
	}
	if h.lazy {
		var errno syscall.Errno
		if h.ents, errno = h.d.entries(ctx); errno != 0 {
			return errno
		}
	}
	h.list, h.done = h.d.listing(h.ents), true
	h.ents = nil
	return 0
}

func (h *dirHandle) Readdirent(ctx context.Context) (*gofuse.DirEntry, syscall.Errno) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if errno := h.build(ctx); errno != 0 {
		return nil, errno
	}
	if h.pos >= len(h.list) {
		return nil, 0
	}
	e := h.list[h.pos]
	h.pos++
	return &e, 0
}

func (h *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	h.mu.Lock()
	defer h.mu.Unlock()
	if errno := h.build(ctx); errno != 0 {
		return errno
	}
	h.pos = int(min(off, uint64(len(h.list))))
	return 0
}

func (h *dirHandle) Releasedir(context.Context, uint32) {}

// blobNode is what files and symlinks share: an object and its size.
type blobNode struct {
	gofs.Inode
	v    *View
	path string
	hash casstore.Hash
	info atomic.Pointer[blobInfo] // set once the size is known
}

type blobInfo struct {
	size    int64
	blocks  uint64
	blksize uint32
}

// unknownAttrTimeout is the attribute lifetime of a blob whose size could not be
// learnt: the kernel asks again at once instead of caching a wrong size for an hour.
const unknownAttrTimeout = time.Nanosecond

// getattr fills out with the object's size, learnt once. When it cannot be learnt
// it fills in size 0 with a lifetime short enough that the kernel asks again, and
// returns why.
func (b *blobNode) getattr(ctx context.Context, mode uint32, owned bool, out *gofuse.AttrOut) error {
	info := b.info.Load()
	if info == nil {
		i, err := b.v.blobInfo(ctx, b.hash)
		if err != nil {
			log.G(b.v.ctx).WithError(err).WithFields(log.Fields{"path": "/" + b.path, "hash": b.hash.String()}).Debug("object size unknown")
			b.v.fillAttr(&out.Attr, b.v.inos.ino(b.path), mode, owned, 0, 0, 0)
			out.SetTimeout(unknownAttrTimeout)
			return err
		}
		b.info.Store(&i)
		info = &i
	}
	b.v.fillAttr(&out.Attr, b.v.inos.ino(b.path), mode, owned, info.size, info.blocks, info.blksize)
	return nil
}

// fileNode is a regular file: opened from the verified object, with passthrough
// where available, or (NoOpen) never opened at all and read by offset. The object
// file, once opened, stays open while the kernel keeps the inode (within a
// process-wide budget), so later opens and reads of the file cost the server no
// syscalls of its own: objects are immutable, so one descriptor can back every open.
type fileNode struct {
	blobNode
	exec bool

	mu     sync.Mutex
	cached *os.File // shared verified object file, or nil
	fd     int      // cached.Fd(), read once (Fd has a syscall's cost)
}

var (
	_ gofs.NodeGetattrer   = (*fileNode)(nil)
	_ gofs.NodeOpener      = (*fileNode)(nil)
	_ gofs.NodeReader      = (*fileNode)(nil)
	_ gofs.NodeFlusher     = (*fileNode)(nil)
	_ gofs.NodeOnForgetter = (*fileNode)(nil)
)

func (f *fileNode) mode() uint32 {
	if f.exec {
		return syscall.S_IFREG | 0o755
	}
	return syscall.S_IFREG | 0o644
}

// Getattr implements gofs.NodeGetattrer (for lookups too). A file whose size cannot
// be learnt (its object is missing everywhere, or the source cannot say) shows size
// 0 for an instant when opens are served, and the open fails. In NoOpen mode the
// kernel would read such a file as empty without asking, so its lookup and stat
// fail instead; failures are not cached, so a later look retries.
func (f *fileNode) Getattr(ctx context.Context, _ gofs.FileHandle, out *gofuse.AttrOut) syscall.Errno {
	if err := f.getattr(ctx, f.mode(), true, out); err != nil && f.v.noOpen.Load() {
		return f.v.fail(err, ErrIO, f.path, f.hash, "cannot learn file size")
	}
	return 0
}

// Open implements gofs.NodeOpener. In NoOpen mode it answers ENOSYS, which the
// kernel takes as "this server has no use for opens": that open and every later one
// on the connection succeed without a request, with their page cache kept.
func (f *fileNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&syscall.O_ACCMODE != syscall.O_RDONLY || flags&syscall.O_TRUNC != 0 {
		return nil, 0, syscall.EROFS
	}
	if f.v.noOpen.Load() {
		return nil, 0, syscall.ENOSYS
	}
	h, errno := f.handle(ctx)
	if errno != 0 {
		return nil, 0, errno
	}
	f.v.stats.Opens.Add(1)
	if h.passthrough {
		f.v.stats.PassthroughOpens.Add(1)
	}
	return h, gofuse.FOPEN_KEEP_CACHE | gofuse.FOPEN_NOFLUSH, 0
}

func (f *fileNode) handle(ctx context.Context) (*fileHandle, syscall.Errno) {
	fd, own, errno := f.object(ctx, "cannot open file")
	if errno != 0 {
		return nil, errno
	}
	return &fileHandle{fd: fd, own: own, passthrough: f.v.passthrough.Load()}, 0
}

// object returns a descriptor of the verified object file, opening (and maybe
// hydrating) it on first use: the node's shared one, or, over the descriptor budget,
// a private file that the caller closes. Failures are logged with msg.
func (f *fileNode) object(ctx context.Context, msg string) (int, *os.File, syscall.Errno) {
	f.mu.Lock()
	if f.cached != nil {
		fd := f.fd
		f.mu.Unlock()
		return fd, nil, 0
	}
	f.mu.Unlock()
	// Open (and maybe hydrate) without the lock, so concurrent first opens wait in
	// the interruptible hydration instead of on a mutex.
	file, err := f.v.openBlob(ctx, f.hash)
	if err != nil {
		return -1, nil, f.v.fail(err, ErrIO, f.path, f.hash, msg)
	}
	fd := int(file.Fd())
	if f.info.Load() == nil {
		var st unix.Stat_t
		if unix.Fstat(fd, &st) == nil {
			f.info.Store(&blobInfo{size: st.Size, blocks: uint64(st.Blocks), blksize: uint32(st.Blksize)})
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cached != nil { // a concurrent open cached its descriptor first
		file.Close()
		return f.fd, nil, 0
	}
	if !f.v.keepOpen(f) {
		return fd, file, 0
	}
	f.cached, f.fd = file, fd
	return fd, nil, 0
}

// Read implements gofs.NodeReader, for every READ that reaches the server: with
// the handle of an open served without passthrough, or in NoOpen mode with none, in
// which case the node's own object file serves it. Reads are spliced from the
// object file, except from a private descriptor (over budget), which is closed
// before the reply is written and so is read into dest first.
func (f *fileNode) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (gofuse.ReadResult, syscall.Errno) {
	f.v.stats.Reads.Add(1)
	if h, ok := fh.(*fileHandle); ok {
		return gofuse.ReadResultFd(uintptr(h.fd), off, len(dest)), 0
	}
	fd, own, errno := f.object(ctx, "cannot read file")
	if errno != 0 {
		return nil, errno
	}
	if own == nil {
		return gofuse.ReadResultFd(uintptr(fd), off, len(dest)), 0
	}
	defer own.Close()
	n, err := own.ReadAt(dest, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, f.v.fail(err, ErrIO, f.path, f.hash, "cannot read file")
	}
	return gofuse.ReadResultData(dest[:n]), 0
}

// Flush implements gofs.NodeFlusher. A read-only view has nothing to flush, and
// ENOSYS tells the kernel so, once for the whole connection. Opens served by Open
// say FOPEN_NOFLUSH and never get here; in NoOpen mode there are no open flags, and
// the kernel would otherwise send a FLUSH at every close.
func (f *fileNode) Flush(context.Context, gofs.FileHandle) syscall.Errno {
	return syscall.ENOSYS
}

// OnForget implements gofs.NodeOnForgetter: the kernel dropped the inode (so no file
// of it is open), and the cached object file can go.
func (f *fileNode) OnForget() { f.v.dropOpen(f) }

// closeCached closes the cached object file, if any, and reports whether there was one.
func (f *fileNode) closeCached() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cached == nil {
		return false
	}
	f.cached.Close()
	f.cached, f.fd = nil, -1
	return true
}

// fileHandle is one open of a file: a descriptor of the verified object file,
// either the node's shared one or (over budget) its own. Its reads are served by
// fileNode.Read.
type fileHandle struct {
	fd          int
	own         *os.File // closed at release; nil when fd is the node's shared one
	passthrough bool
}

var (
	_ gofs.FilePassthroughFder = (*fileHandle)(nil)
	_ gofs.FileReleaser        = (*fileHandle)(nil)
)

// PassthroughFd hands the object file to the kernel, which then reads it directly.
func (h *fileHandle) PassthroughFd() (int, bool) {
	return h.fd, h.passthrough
}

// Release closes a private object file.
func (h *fileHandle) Release(context.Context) syscall.Errno {
	if h.own != nil {
		h.own.Close()
	}
	return 0
}

// linkNode is a symlink whose target is the (verified) blob.
type linkNode struct {
	blobNode
}

var (
	_ gofs.NodeGetattrer  = (*linkNode)(nil)
	_ gofs.NodeReadlinker = (*linkNode)(nil)
)

// Getattr implements gofs.NodeGetattrer.
func (l *linkNode) Getattr(ctx context.Context, _ gofs.FileHandle, out *gofuse.AttrOut) syscall.Errno {
	l.getattr(ctx, syscall.S_IFLNK|0o777, true, out)
	return 0
}

// Readlink implements gofs.NodeReadlinker.
func (l *linkNode) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	b, err := l.v.readBlob(ctx, l.hash, maxLinkTarget)
	if err != nil {
		return nil, l.v.fail(err, ErrIO, l.path, l.hash, "cannot read symlink")
	}
	l.v.stats.Readlinks.Add(1)
	return b, 0
}

// fillAttr writes the attributes every entry of a view shares: fixed times, nlink 1
// (a blob shared by two paths is not a hard link), the owner for tree entries.
func (v *View) fillAttr(out *gofuse.Attr, ino uint64, mode uint32, owned bool, size int64, blocks uint64, blksize uint32) {
	out.Ino = ino
	out.Mode = mode
	out.Nlink = 1
	out.Size = uint64(size)
	out.Blocks = blocks
	if blksize == 0 {
		blksize = 4096
	}
	out.Blksize = blksize
	if owned {
		out.Uid, out.Gid = v.opts.UID, v.opts.GID
	} else {
		out.Uid, out.Gid = 0, 0
	}
	out.SetTimes(&v.mtime, &v.mtime, &v.mtime)
}

// blobInfo learns an object's size without reading it: from the object file's stat
// when local, from the source otherwise.
func (v *View) blobInfo(ctx context.Context, h casstore.Hash) (blobInfo, error) {
	var st unix.Stat_t
	err := unix.Stat(v.store.Path(h), &st)
	if err == unix.ENOENT {
		// Published late (a branch's object still in its journal)?
		if ok, _ := v.store.Materialize(h); ok {
			err = unix.Stat(v.store.Path(h), &st)
		}
	}
	switch {
	case err == nil:
		return blobInfo{size: st.Size, blocks: uint64(st.Blocks), blksize: uint32(st.Blksize)}, nil
	case h == casstore.EmptyHash:
		return blobInfo{}, nil
	case err != unix.ENOENT:
		return blobInfo{}, fmt.Errorf("stat object %s: %w", h, err)
	case v.opts.Source == nil:
		return blobInfo{}, fmtNotLocal(h)
	}
	size, err := v.opts.Source.Stat(ctx, h)
	if err == nil && size < 0 {
		err = fmt.Errorf("negative size %d", size)
	}
	if err != nil {
		return blobInfo{}, fmt.Errorf("%w: size of %s at the source: %w", errHydrate, h, err)
	}
	return blobInfo{size: size, blocks: uint64((size + 511) / 512)}, nil
}

// openBlob opens an object verified, hydrating it first if it is not local.
func (v *View) openBlob(ctx context.Context, h casstore.Hash) (*os.File, error) {
	f, err := v.store.Open(h)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return f, err
	}
	if err := v.fetch(ctx, h); err != nil {
		return nil, err
	}
	return v.store.Open(h)
}

// readBlob reads a small object verified, hydrating it first if it is not local.
func (v *View) readBlob(ctx context.Context, h casstore.Hash, max int64) ([]byte, error) {
	b, err := v.store.ReadAll(h, max)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return b, err
	}
	if err := v.fetch(ctx, h); err != nil {
		return nil, err
	}
	return v.store.ReadAll(h, max)
}

// readTree decodes a tree object, hydrating it first if it is not local.
func (v *View) readTree(ctx context.Context, h casstore.Hash) (casstore.Tree, error) {
	t, err := v.store.ReadTree(h)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return t, err
	}
	if err := v.fetch(ctx, h); err != nil {
		return nil, err
	}
	return v.store.ReadTree(h)
}

// fetch makes a missing object local. The empty object needs no source: it is
// written directly (a LunarFS store may lack it).
func (v *View) fetch(ctx context.Context, h casstore.Hash) error {
	if h == casstore.EmptyHash {
		_, err := v.store.PutBytes(nil)
		return err
	}
	if v.opts.Source == nil {
		return fmtNotLocal(h)
	}
	return hydrate(ctx, v.ctx, v.store, v.opts.Source, h, v.stats)
}

func fmtNotLocal(h casstore.Hash) error {
	return fmt.Errorf("object %s is not in the store and the view has no source: %w", h, errdefs.ErrNotFound)
}

// fail turns an error into EIO for the kernel, after counting and logging it with the
// path and object, so one bad object costs one file and leaves a trace.
func (v *View) fail(err error, fallback ErrorKind, p string, h casstore.Hash, msg string) syscall.Errno {
	kind := fallback
	var corrupt *casstore.CorruptError
	switch {
	case errors.Is(err, errHydrate):
		kind = ErrHydrate
	case errors.As(err, &corrupt), errors.Is(err, errdefs.ErrDataLoss):
		kind = ErrCorrupt
	case errors.Is(err, errdefs.ErrNotFound):
		kind = ErrMissing
	case errors.Is(err, context.Canceled):
		return syscall.EINTR
	}
	v.stats.addError(kind)
	log.G(v.ctx).WithError(err).WithFields(log.Fields{
		"path": "/" + p, "hash": h.String(), "kind": kind.String(),
	}).Error(msg)
	return syscall.EIO
}

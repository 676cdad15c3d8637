package kview

import (
	"cmp"
	"sync"
	"time"
	"unsafe"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Build scratch: the memory an image build works in, kept from one build to the
// next.
//
// A build of the Go source tree's image works in about 6 MB: a node per entry, the
// inode table, the set and list of file objects, the write buffer (a derivation,
// derive.go, in the 3 MB of its copy of an image). Freed after the build, those pages
// do not stay with the process: the Go runtime's scavenger hands idle heap back to the
// kernel within seconds, and neither a higher GOGC (the heap grows into new pages
// instead) nor MADV_FREE changes that (both measured). The next build, seconds later,
// then takes a page fault on every page it touches. On bare
// metal a fault costs well under a microsecond; in a guest whose page tables the host
// nests or shadows it costs far more (15 µs on the VM this was measured on, where
// 1,500 faults were 19 of a build's 48 ms: BenchmarkImageBuildAfterIdle), and agent
// fleets run in exactly such guests. A build is on a container's create path, so the
// cache keeps the largest parts of a build's memory (scratch): one for good, and a
// second (concurrent builds) until scratchIdle after the last build ends, each at most
// maxScratchBytes (7 MiB for the Go source tree, derivations included). A starting
// process faults one in ahead of its first build (WarmTrees).
//
// A scratch belongs to one build at a time: the Tree a scan assembles in it (its
// nodes, its object list) is valid only until the scratch is put back, so a Tree
// built in a scratch never leaves the build (Cache.build).

const (
	maxFreeScratch  = 2
	maxScratchBytes = 64 << 20 // about the scratch of a tree of 100,000 entries
	scratchIdle     = 5 * time.Minute
)

// scratch is the reusable memory of one build.
type scratch struct {
	nodes   slab[node]
	kids    slab[*node]
	seen    map[casstore.Hash]struct{} // the assembler's set of file objects
	seenMax int                        // the most entries seen has held (clear keeps its memory)
	objects []casstore.Hash            // the Tree's object list
	objList []byte                     // the object list as KEY.objects holds it
	slots   []byte                     // a derivation's owner slots (KEY.owners)
	image   []byte                     // a derivation's image
	inodes  []inode                    // the image layout's inode table
	names   []dirName                  // the image layout's directory entries
	buf     []byte                     // the image writer's buffer
}

// reset empties s for the next build, dropping what it points at.
func (s *scratch) reset() {
	s.nodes.reset()
	s.kids.reset()
	s.seenMax = max(s.seenMax, len(s.seen))
	clear(s.seen)
	s.objects = s.objects[:0]
	s.objList = s.objList[:0]
	s.slots = s.slots[:0]
	s.image = s.image[:0]
	clear(s.inodes) // they point at nodes
	s.inodes = s.inodes[:0]
	s.names = s.names[:0]
	s.buf = s.buf[:0]
}

// bytes is about how much memory s keeps.
func (s *scratch) bytes() int {
	const hashEntry = int(unsafe.Sizeof(casstore.Hash{})) + 8 // a set entry, roughly
	return s.nodes.bytes() + s.kids.bytes() + hashEntry*max(s.seenMax, len(s.seen)) +
		int(unsafe.Sizeof(casstore.Hash{}))*cap(s.objects) + cap(s.objList) + cap(s.slots) + cap(s.image) +
		int(unsafe.Sizeof(inode{}))*cap(s.inodes) + int(unsafe.Sizeof(dirName(0)))*cap(s.names) + cap(s.buf)
}

// slab hands out zeroed slices of T carved from a few large arrays, which it keeps
// across resets.
type slab[T any] struct {
	chunks [][]T
	ci     int // the chunk being carved
	off    int // how much of it is handed out
}

// minSlabChunk is the size of a slab's first array; each next one is twice the last.
const minSlabChunk = 1024

// take returns n zeroed elements, valid until reset.
func (s *slab[T]) take(n int) []T {
	for ; s.ci < len(s.chunks); s.ci, s.off = s.ci+1, 0 {
		if c := s.chunks[s.ci]; s.off+n <= len(c) {
			s.off += n
			return c[s.off-n : s.off : s.off]
		}
	}
	size := minSlabChunk
	if k := len(s.chunks); k > 0 {
		size = 2 * len(s.chunks[k-1])
	}
	s.chunks = append(s.chunks, make([]T, max(size, n)))
	s.ci, s.off = len(s.chunks)-1, n
	return s.chunks[s.ci][:n:n]
}

// reset zeroes what was handed out and makes it available again.
func (s *slab[T]) reset() {
	for i := 0; i < s.ci && i < len(s.chunks); i++ {
		clear(s.chunks[i])
	}
	if s.ci < len(s.chunks) {
		clear(s.chunks[s.ci][:s.off])
	}
	s.ci, s.off = 0, 0
}

func (s *slab[T]) bytes() int {
	var zero T
	n := 0
	for _, c := range s.chunks {
		n += len(c)
	}
	return n * int(unsafe.Sizeof(zero))
}

// scratchPool keeps the scratch of recent builds for the next ones. Its zero value
// keeps up to maxFreeScratch of at most maxScratchBytes each, all but one only until
// it has been idle for scratchIdle.
type scratchPool struct {
	mu    sync.Mutex
	free  []*scratch
	timer *time.Timer // drops free once the pool has been idle long enough
	// idle and limit replace scratchIdle and maxScratchBytes when set (tests).
	idle  time.Duration
	limit int
}

// get returns a scratch for one build: a kept one if there is one.
func (p *scratchPool) get() *scratch {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n := len(p.free); n > 0 {
		s := p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
		return s
	}
	return &scratch{}
}

// put takes back a scratch whose build is over (and everything built in it).
func (p *scratchPool) put(s *scratch) {
	limit, idle := cmp.Or(p.limit, maxScratchBytes), cmp.Or(p.idle, scratchIdle)
	if s.bytes() > limit {
		return // a very large tree's: not worth holding on to
	}
	s.reset()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) < maxFreeScratch {
		p.free = append(p.free, s)
	}
	if p.timer == nil {
		p.timer = time.AfterFunc(idle, p.trim)
	} else {
		p.timer.Reset(idle)
	}
}

// trim lets the garbage collector have all kept scratch but the last one put back.
func (p *scratchPool) trim() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n := len(p.free); n > 1 {
		p.free[0] = p.free[n-1]
		clear(p.free[1:])
		p.free = p.free[:1]
	}
}

// drop lets the garbage collector have every kept scratch (benchmarks).
func (p *scratchPool) drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.free)
	p.free = p.free[:0]
}

// kept is how many scratch the pool holds (tests).
func (p *scratchPool) kept() []*scratch {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*scratch(nil), p.free...)
}

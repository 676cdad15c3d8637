package kview

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Reading ahead the data of a view mounted onto cold caches.
//
// A kernel view costs the kernel more per file than a baked image layer the first
// time each file is opened: an EROFS inode and its redirect, an overlay inode, and
// the object's own dentry and inode. On warm caches that is noise; on cold caches
// (after a reboot, or once memory pressure has evicted the tree) a reader that opens
// one file after another waits for each file's data read in turn, and the extra
// work per file sits between those waits: measured here, `find | xargs cat` of the
// Go source tree through a view took 1.14x the time of the same tree baked into an
// image, with the same number of disk reads.
//
// The view knows what its container will read: the image's object list, in tree
// order (the order `find`, `grep -r` and a compiler walk it). So when a view is
// mounted and its own image was not in the page cache (the sign of cold caches, as
// an image in use or just built always is), the host reads ahead the data of the
// view's files in the background, a few objects at a time, up to a budget of
// bytes, as stargz-snapshotter's background fetch and nydus's prefetch do for their
// layers. The reader then finds its files' pages cached or on their way. Warm mounts
// pay nothing, and a view whose objects are cached costs the kernel a walk of their
// pages. Objects are shared by every view of the tree, so one read-ahead of a key runs
// at a time.

// coldPrefetchWorkers is how many objects are read ahead at once: enough to keep a
// disk's queue busy while each worker waits on an object's inode.
const coldPrefetchWorkers = 4

// coldReadAheadsAtOnce is how many views' read-aheads run at once on a host; more
// wait their turn. A host that restarts many containers on cold caches (after a
// reboot) thus keeps a bounded number of reads queued at the disk, the views mounted
// first served first; views of trees that share objects find them cached by then.
const coldReadAheadsAtOnce = 2

// imageCold reports whether fewer than half the pages of the open image file f are
// in the page cache.
func imageCold(f *os.File) (bool, error) {
	in, total, err := residentFile(f)
	return in*2 < total, err
}

// residentFile counts the pages of the open file f that are in the page cache
// (mincore over a mapping of it).
func residentFile(f *os.File) (in, total int, err error) {
	st, err := f.Stat()
	if err != nil || st.Size() == 0 {
		return 0, 0, err
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, 0, fmt.Errorf("map %s: %w", f.Name(), err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return 0, 0, fmt.Errorf("mincore %s: %w", f.Name(), errno)
	}
	for _, v := range vec {
		in += int(v & 1)
	}
	return in, len(vec), nil
}

// coldReader runs the read-aheads of one host, one per image key at a time, and
// stops them when the host closes.
type coldReader struct {
	store *casstore.Store
	stats *Stats
	ctx   context.Context
	stop  context.CancelFunc
	wg    sync.WaitGroup

	slots chan struct{} // one per read-ahead running (coldReadAheadsAtOnce)

	mu      sync.Mutex
	running map[string]bool // keys started, running or waiting for a slot
	closed  bool
}

func newColdReader(store *casstore.Store, stats *Stats) *coldReader {
	ctx, stop := context.WithCancel(context.Background())
	return &coldReader{store: store, stats: stats, ctx: ctx, stop: stop, running: map[string]bool{},
		slots: make(chan struct{}, coldReadAheadsAtOnce)}
}

// start reads ahead, in the background, the objects listed in list (an image's
// KEY.objects) up to budget bytes, unless a read-ahead of key is under way. It logs
// with ctx's logger (the mount's, whose fields name the view).
func (r *coldReader) start(ctx context.Context, key, list string, budget int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.running[key] {
		return
	}
	r.running[key] = true
	r.wg.Add(1)
	l := log.G(ctx)
	go func() {
		defer r.wg.Done()
		defer func() {
			r.mu.Lock()
			delete(r.running, key)
			r.mu.Unlock()
		}()
		select {
		case r.slots <- struct{}{}:
			defer func() { <-r.slots }()
		case <-r.ctx.Done():
			return
		}
		start := time.Now()
		objects, bytes, err := r.read(r.ctx, list, budget)
		r.stats.ColdReadAheads.Add(1)
		r.stats.ColdReadAheadBytes.Add(bytes)
		l = l.WithFields(log.Fields{"objects": objects, "bytes": bytes, "elapsed": time.Since(start)})
		if err != nil && !errors.Is(err, context.Canceled) {
			l.WithError(err).Warn("reading ahead a cold kernel view's files failed")
			return
		}
		l.Debug("read ahead the files of a kernel view mounted onto cold caches")
	}()
}

// read opens each listed object in turn (coldPrefetchWorkers at once) and asks the
// kernel to read it into the page cache (POSIX_FADV_WILLNEED, which queues the reads
// and returns), until the objects' sizes add up to budget. Objects that are not in
// the store are skipped: the view's open of them reports it.
func (r *coldReader) read(ctx context.Context, list string, budget int64) (objects int, bytes int64, err error) {
	b, err := os.ReadFile(list)
	if err != nil {
		return 0, 0, err
	}
	n := len(b) / len(casstore.Hash{})
	od := &objDirs{store: r.store, root: r.store.Root()}
	defer od.close()
	var next, done, total atomic.Int64
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	for w := 0; w < coldPrefetchWorkers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && total.Load() < budget {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				var h casstore.Hash
				copy(h[:], b[i*len(h):])
				size, err := od.readAhead(h)
				if err != nil {
					errOnce.Do(func() { firstErr = err })
					return
				}
				if size >= 0 {
					done.Add(1)
					total.Add(size)
				}
			}
		}()
	}
	wg.Wait()
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return int(done.Load()), total.Load(), firstErr
}

// readAhead asks the kernel to read object h into the page cache and returns its
// size, or -1 if it is not in the store.
func (od *objDirs) readAhead(h casstore.Hash) (int64, error) {
	dirfd, err := od.dir(h)
	if err != nil || dirfd < 0 {
		return -1, err
	}
	const flags = unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK
	fd, err := unix.Openat(dirfd, h.String()[2:], flags|unix.O_NOATIME, 0)
	if errors.Is(err, unix.EPERM) { // O_NOATIME needs the file's owner (or CAP_FOWNER)
		fd, err = unix.Openat(dirfd, h.String()[2:], flags, 0)
	}
	if errors.Is(err, unix.ENOENT) {
		return -1, nil
	}
	if err != nil {
		return -1, fmt.Errorf("object %s: %w", h, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return -1, fmt.Errorf("object %s: %w", h, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return -1, nil
	}
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_WILLNEED); err != nil {
		return -1, fmt.Errorf("object %s: read-ahead: %w", h, err)
	}
	return st.Size, nil
}

// close stops the read-aheads under way and waits for them.
func (r *coldReader) close() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.stop()
	r.wg.Wait()
}

package ingest

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Options tunes an ingest. The zero value is Tidepool's default mode.
type Options struct {
	// LunarStrict reproduces LunarFS exactly: symlinks are dropped like special files,
	// so the root equals what `lunar ingest` prints for the same directory. Without
	// it, symlinks become casstore.ModeSymlink entries whose blob is the link target.
	LunarStrict bool
	// Strict refuses FIFOs, sockets and device nodes (other than overlay whiteouts)
	// with ErrSpecialFile instead of dropping them: trees cannot hold them, and a
	// caller that must not lose anything silently asks for the error.
	Strict bool
	// Workers bounds how many files are hashed and stored at once; 0 picks a default
	// suited to the machine (file IO overlaps hashing, so a few more than the CPUs).
	Workers int
	// Progress, if set, is called with the running totals while files are hashed (at
	// most every ProgressInterval, from one goroutine at a time) and once more at the
	// end. It must return quickly: it runs on the ingest's workers.
	Progress func(Progress)
	// Record, if set, is called with the new root after its objects are published
	// and before the store's GC lock is released, so whatever it records (a fork's
	// new root) is live before any garbage collection can look. Its error is the
	// ingest's error; the objects stay published (unreferenced, for gc).
	Record func(root casstore.Hash) error
	// Read, if set, is called once every entry of the source has been read (files
	// staged in the store's temp area), before trees are written and objects
	// published: after it the source may change freely. A caller that froze the
	// source's writers (a container being branched) lets them go here. It is called
	// at most once, and not at all if the walk fails.
	Read func()
	// BufferBytes, if positive, keeps up to that many bytes of new objects in
	// memory while the source is read, writing them to the store only after Read:
	// the source is read, not copied, in the time Read ends.
	BufferBytes int64
	// Lowers are the overlay's lower layers below the base tree, top first (Upper
	// only: a container image's layers). A metadata-only copy-up (metacopy=on) whose
	// origin the base does not hold, a file of the image chmodded or renamed into the
	// tree, takes its data from the first of them that shows a regular file there.
	// Without them such a copy-up is an error. Nothing else is read from them.
	Lowers []string
}

// ProgressInterval is the minimum time between two Progress calls (the final call is
// always made).
const ProgressInterval = 100 * time.Millisecond

// Progress is a snapshot of an ingest in flight, enough for a progress bar.
type Progress struct {
	Files int64 // regular files hashed and stored so far
	Bytes int64 // their total size
	// FoundFiles and FoundBytes count the regular files the directory walk has found so
	// far; they are final once WalkDone is true, and can then be used as the bar's total.
	FoundFiles int64
	FoundBytes int64
	WalkDone   bool
}

// Stats summarizes a finished ingest.
type Stats struct {
	Files    int64 // regular files ingested
	Dirs     int64 // directories ingested, the root included
	Symlinks int64 // symlinks recorded (always 0 with LunarStrict)
	Skipped  int64 // entries left out: .git, FIFOs, sockets, devices, and symlinks with LunarStrict
	Special  int64 // of Skipped, the FIFOs, sockets and device nodes (each logged at warning level)
	Bytes    int64 // total size of the regular files
}

// ErrNameCollision is wrapped by the error returned when two names in one directory
// become the same name once converted to UTF-8. LunarFS would write both as duplicate
// entries; Tidepool's tree codec refuses duplicates on read, so it never writes them.
var ErrNameCollision = fmt.Errorf("names collide after conversion to UTF-8: %w", errdefs.ErrInvalidArgument)

// ErrSpecialFile is wrapped by the error for a FIFO, socket or device node met with
// Options.Strict.
var ErrSpecialFile = fmt.Errorf("special file (FIFO, socket or device) cannot be stored: %w", errdefs.ErrInvalidArgument)

// ErrRedirect is wrapped by Upper's error for an overlay redirect it cannot follow: a
// malformed xattr value, or a renamed directory whose lower content lies outside the
// base tree (a directory of the image moved into the tree: its content is in the
// image's layers, which Upper does not read).
var ErrRedirect = fmt.Errorf("overlay redirect cannot be followed: %w", errdefs.ErrFailedPrecondition)

// defaultWorkers is used when Options.Workers is 0.
const defaultWorkers = 4

// counters is the progress and stats state shared by the walker and the workers.
type counters struct {
	files, bytes           atomic.Int64
	foundFiles, foundBytes atomic.Int64
	walkDone               atomic.Bool

	// Walker-only counters: read after the walk has finished.
	dirs, symlinks, skipped, special int64

	cb   func(Progress)
	mu   sync.Mutex
	last time.Time
}

func (c *counters) snapshot() Progress {
	return Progress{
		Files:      c.files.Load(),
		Bytes:      c.bytes.Load(),
		FoundFiles: c.foundFiles.Load(),
		FoundBytes: c.foundBytes.Load(),
		WalkDone:   c.walkDone.Load(),
	}
}

// report calls the progress callback if it is due (or force is set).
func (c *counters) report(force bool) {
	if c.cb == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if !force && now.Sub(c.last) < ProgressInterval {
		return
	}
	c.last = now
	c.cb(c.snapshot())
}

func (c *counters) stats() Stats {
	return Stats{
		Files:    c.files.Load(),
		Dirs:     c.dirs,
		Symlinks: c.symlinks,
		Skipped:  c.skipped,
		Special:  c.special,
		Bytes:    c.bytes.Load(),
	}
}

// errInvalid marks errors in what the caller asked for.
var errInvalid = errdefs.ErrInvalidArgument

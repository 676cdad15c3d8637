package kview

import "sync/atomic"

// Stats counts what the image cache did, for the daemon's metrics.
type Stats struct {
	Builds     atomic.Int64 // images built from a scan of their tree
	Derived    atomic.Int64 // images derived from another owner's image of their tree
	BuildNanos atomic.Int64 // time spent building and deriving them
	BuildBytes atomic.Int64 // bytes of the images built
	CacheHits  atomic.Int64 // mounts that found their image cached
	// ObjectChecks counts the object lists of cached images checked against the
	// store, one lookup per object; a hit whose list the size index showed whole,
	// with nothing forgotten since, skips it (checked.go).
	ObjectChecks atomic.Int64
	// TreesRead counts the tree objects builds read from the store; the others came
	// from the memo of decoded trees.
	TreesRead atomic.Int64
	// TreesWarmed counts the tree objects decoded into the memo when the process
	// started, from the roots of the images it used last (warm.go).
	TreesWarmed atomic.Int64
	// ColdReadAheads counts the views mounted onto cold caches whose files' data was
	// read ahead (coldread.go), and ColdReadAheadBytes the bytes of the objects read
	// ahead.
	ColdReadAheads     atomic.Int64
	ColdReadAheadBytes atomic.Int64
}

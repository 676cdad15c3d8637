package fuse

import "sync/atomic"

// Stats counts what views do, for the daemon to export as metrics. All fields are
// atomic so one Stats can be shared by every view of a process (pass the same pointer
// in Options.Stats) and read at any time without locking.
type Stats struct {
	// Lookups counts LOOKUP requests answered (including those made by READDIRPLUS).
	Lookups atomic.Uint64
	// Readdirs counts directory listings built. The kernel caches the listings of
	// tree directories, so re-reading one costs nothing until the cache is dropped.
	Readdirs atomic.Uint64
	// Opens counts files opened successfully. Views in NoOpen mode never see opens
	// (the kernel opens their files without asking), so they add nothing here.
	Opens atomic.Uint64
	// PassthroughOpens counts opens served with FUSE passthrough, whose reads never
	// reach this process.
	PassthroughOpens atomic.Uint64
	// Reads counts READ requests that reached this process: zero while passthrough
	// serves every open file; in NoOpen mode, one per page-cache miss.
	Reads atomic.Uint64
	// Readlinks counts symlink targets served.
	Readlinks atomic.Uint64
	// Hydrations counts objects fetched from the BlobSource and stored locally.
	Hydrations atomic.Uint64
	// HydratedBytes is the total size of those objects.
	HydratedBytes atomic.Uint64

	errors [numErrorKinds]atomic.Uint64
}

// ErrorKind classifies failures, so that a corrupt store, a missing object and a
// flaky remote show up as different series.
type ErrorKind int

// The kinds of failure a view reports. Each failure also gives EIO to the caller
// and a log line naming the path and the object.
const (
	// ErrMissing: an object is neither in the local store nor obtainable (no source).
	ErrMissing ErrorKind = iota
	// ErrCorrupt: a local object's bytes do not hash to its name.
	ErrCorrupt
	// ErrHydrate: fetching from the BlobSource failed or returned wrong bytes.
	ErrHydrate
	// ErrTree: a tree object could not be decoded (or holds an unsafe entry).
	ErrTree
	// ErrIO: any other error from the local filesystem.
	ErrIO
	numErrorKinds
)

// ErrorKinds lists every kind, in a stable order, for exporters.
func ErrorKinds() []ErrorKind {
	k := make([]ErrorKind, numErrorKinds)
	for i := range k {
		k[i] = ErrorKind(i)
	}
	return k
}

// String is the kind's label value in metrics ("missing", "corrupt", ...).
func (k ErrorKind) String() string {
	switch k {
	case ErrMissing:
		return "missing"
	case ErrCorrupt:
		return "corrupt"
	case ErrHydrate:
		return "hydrate"
	case ErrTree:
		return "tree"
	case ErrIO:
		return "io"
	}
	return "unknown"
}

// Errors returns how many failures of kind k were reported.
func (s *Stats) Errors(k ErrorKind) uint64 {
	if k < 0 || k >= numErrorKinds {
		return 0
	}
	return s.errors[k].Load()
}

func (s *Stats) addError(k ErrorKind) { s.errors[k].Add(1) }

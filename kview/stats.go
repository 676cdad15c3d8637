package kview

import "sync/atomic"

// Stats counts what the image cache did, for the daemon's metrics.
type Stats struct {
	Builds     atomic.Int64 // images built
	BuildNanos atomic.Int64 // time spent building them (scan + write)
	BuildBytes atomic.Int64 // bytes of the images built
	CacheHits  atomic.Int64 // mounts that found their image cached
}

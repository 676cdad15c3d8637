package kview

import (
	"sync"

	"github.com/tidepool-dev/tidepool/casstore"
)

// A cache hit must not mount a view whose objects have left the store, so it checks
// the image's object list (KEY.objects) against the store: an object the size index
// knows is present (casstore's sizes.go: whatever removes objects forgets their
// entries first), any other is stat-ed. That is a map lookup per file, 11.5k of them
// for the Go source tree, and between containers each one misses the CPU's caches: 3
// to 5 ms of the Prepare of every container on a cached image (README, figures).
//
// checkedLists makes the common hit cheap: a refresh of the index (an open, a stat
// and one 48-byte read) instead of a lookup per object. It remembers, per image, the
// size index's epoch (casstore.SizeEpoch) at which every object of the image's list
// was found in the index. While the epoch is the same, no entry has been forgotten or
// spoiled since, so the same lookups would find every object again: the hit skips
// them.
// Lists with objects the index did not know (stored by LunarFS, or before the index
// existed) are never remembered: a stat of each is the only check there is for them.
// The memory is the process's: a restarted tidepoold checks each image once.
type checkedLists struct {
	mu sync.Mutex
	m  map[string]casstore.SizeEpoch
}

// at reports whether key's list was found whole in the index at epoch e.
func (cl *checkedLists) at(key string, e casstore.SizeEpoch) bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	got, ok := cl.m[key]
	return ok && got == e
}

// set remembers that key's list was found whole in the index at epoch e.
func (cl *checkedLists) set(key string, e casstore.SizeEpoch) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.m == nil {
		cl.m = map[string]casstore.SizeEpoch{}
	}
	cl.m[key] = e
}

// copy gives to what from has: the image of to has from's object list.
func (cl *checkedLists) copy(from, to string) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if e, ok := cl.m[from]; ok {
		cl.m[to] = e
	} else {
		delete(cl.m, to)
	}
}

// drop forgets key's list.
func (cl *checkedLists) drop(key string) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	delete(cl.m, key)
}

// listUnchanged reports whether key's object list was found whole in the size index
// at the epoch od refreshed it to, so that checking it again would find every object.
func (c *Cache) listUnchanged(od *objDirs, key string) bool {
	return od.epochOK && c.checked.at(key, od.epoch)
}

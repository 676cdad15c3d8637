package fuse

import (
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// openBudget caps how many object files all views of the process keep open between
// opens (half the descriptor limit), so caching never starves the process of fds.
var openBudget = func() *budget {
	var r unix.Rlimit
	limit := int64(1024)
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil && r.Cur < 1<<40 {
		limit = int64(r.Cur)
	}
	return &budget{max: limit / 2}
}()

type budget struct {
	used atomic.Int64
	max  int64
}

func (b *budget) take() bool {
	if b.used.Add(1) > b.max {
		b.used.Add(-1)
		return false
	}
	return true
}

func (b *budget) give() { b.used.Add(-1) }

// keepOpen registers f as holding a cached object file, if the budget allows and the
// view is still serving. The caller holds f.mu.
func (v *View) keepOpen(f *fileNode) bool {
	v.openMu.Lock()
	defer v.openMu.Unlock()
	if v.open == nil || !openBudget.take() {
		return false
	}
	v.open[f] = struct{}{}
	return true
}

// dropOpen closes f's cached object file. Node locks are taken after v.openMu is
// released: handle takes them in the other order.
func (v *View) dropOpen(f *fileNode) {
	v.openMu.Lock()
	_, ok := v.open[f]
	delete(v.open, f)
	v.openMu.Unlock()
	if ok && f.closeCached() {
		openBudget.give()
	}
}

// closeAllOpen closes every cached object file once the server has exited (the
// kernel does not send FORGET for what it still held at unmount).
func (v *View) closeAllOpen() {
	v.openMu.Lock()
	open := v.open
	v.open = nil
	v.openMu.Unlock()
	for f := range open {
		if f.closeCached() {
			openBudget.give()
		}
	}
}

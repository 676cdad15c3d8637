// Package groupcommit runs concurrent small writes to one database in shared
// transactions.
//
// A bbolt write transaction ends with an fsync, and bbolt runs one writer at a time,
// so 50 claims that each record one label wait for 50 fsyncs in a row: the 50th
// claim waits for all of them. bbolt's own DB.Batch coalesces, but it holds every
// write for up to MaxBatchDelay first, which a lone write (the common case) would pay.
// A Group commits at once when no transaction is running; writes that arrive while
// one runs wait for it and then commit together, in one transaction, led by the first
// of them. A lone write costs what it did; n concurrent writes cost about two
// transactions, not n.
//
// If a shared transaction fails, each of its writes is retried in a transaction of its
// own, so one write's error (a snapshot that is gone) never fails another's; a write
// function may therefore run more than once and must not have effects outside the
// transaction.
package groupcommit

import "sync"

// Group coalesces writes of type func(T) error, where T is the handle a transaction
// gives its writes (a *bolt.Tx, or a context carrying one).
type Group[T any] struct {
	// Commit runs apply in one write transaction, committing it if apply returns nil.
	Commit func(apply func(T) error) error

	mu      sync.Mutex
	running bool
	queue   []*write[T]
}

type write[T any] struct {
	fn   func(T) error
	done chan error    // the write's outcome
	lead chan struct{} // closed when this write is to lead the next transaction
}

// Do runs fn in a write transaction, possibly shared with concurrent writes, and
// returns fn's error or the transaction's.
func (g *Group[T]) Do(fn func(T) error) error {
	w := &write[T]{fn: fn, done: make(chan error, 1), lead: make(chan struct{})}
	g.mu.Lock()
	g.queue = append(g.queue, w)
	if g.running {
		g.mu.Unlock()
		select {
		case err := <-w.done:
			return err
		case <-w.lead:
		}
		g.mu.Lock()
	}
	g.running = true
	batch := g.queue
	g.queue = nil
	g.mu.Unlock()

	g.commit(batch)

	// Hand the lead to the first waiting write, if any.
	g.mu.Lock()
	if len(g.queue) > 0 {
		close(g.queue[0].lead)
	} else {
		g.running = false
	}
	g.mu.Unlock()
	return <-w.done
}

// commit runs batch in one transaction, or each write alone if that fails.
func (g *Group[T]) commit(batch []*write[T]) {
	if len(batch) == 1 {
		batch[0].done <- g.Commit(batch[0].fn)
		return
	}
	err := g.Commit(func(tx T) error {
		for _, w := range batch {
			if err := w.fn(tx); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil {
		for _, w := range batch {
			w.done <- nil
		}
		return
	}
	for _, w := range batch {
		w.done <- g.Commit(w.fn)
	}
}

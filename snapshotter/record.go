package snapshotter

import (
	"context"
	"fmt"
	"sync"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore"
)

// A late bind (a pool claim) makes two durable records: a pin of the fork's root in
// the fork database (so garbage collection keeps it while the snapshot shows it) and
// labels on the snapshot saying which fork it bound (labelForkID, labelBase). Each is a
// bbolt transaction ending in an fsync, and in a burst of claims those fsyncs queue
// behind each other and behind every other writer of the disk. The claim does not wait
// for them. It checks that the root is stored while holding the store's GC lock
// (shared), binds the view, and leaves both records to a background write that keeps
// holding, until they are written:
//   - the store's GC lock, so no collection runs before the pin is durable;
//   - the snapshot's lock, so every later operation that reads the binding (commit,
//     removal, branching, another bind) sees the labels.
//
// If a write fails, the snapshot's next such operation writes the records again before
// it reads them, and fails if that fails too. A daemon crash before they land leaves a
// claimed member recorded as unbound; members do not outlive a daemon crash (reconcile
// destroys them), so what is lost is what that workload wrote in the milliseconds
// before the crash, and its caller saw the run fail.
type bindRecords struct {
	running    sync.WaitGroup
	mu         sync.Mutex
	unrecorded map[string]bindRecord // key -> records whose write failed
}

// bindRecord is what a late bind records.
type bindRecord struct {
	pin    casstore.Hash
	labels map[string]string
}

// recordBehind writes rec for key in the background and then calls release (which
// releases the locks the caller handed over).
func (s *Snapshotter) recordBehind(ctx context.Context, key string, rec bindRecord, release func()) {
	ctx = context.WithoutCancel(ctx)
	s.records.running.Add(1)
	go func() {
		defer s.records.running.Done()
		defer release()
		if err := s.writeRecord(ctx, key, rec); err != nil {
			log.G(ctx).WithError(err).WithField("key", key).Error("recording a bind failed; the snapshot's next operation writes it again")
			s.records.mu.Lock()
			if s.records.unrecorded == nil {
				s.records.unrecorded = map[string]bindRecord{}
			}
			s.records.unrecorded[key] = rec
			s.records.mu.Unlock()
		}
	}()
}

func (s *Snapshotter) writeRecord(ctx context.Context, key string, rec bindRecord) error {
	if err := s.forks.Pin(pinName(key), rec.pin); err != nil {
		return fmt.Errorf("pin root %s: %w", rec.pin, err)
	}
	return s.setLabels(ctx, key, rec.labels)
}

// recordPending writes the records of key's bind if their background write failed
// (and forgets them if the snapshot or its root is gone). The caller holds key's lock.
func (s *Snapshotter) recordPending(ctx context.Context, key string) error {
	s.records.mu.Lock()
	rec, ok := s.records.unrecorded[key]
	s.records.mu.Unlock()
	if !ok {
		return nil
	}
	if err := s.writeRecord(context.WithoutCancel(ctx), key, rec); err != nil {
		if !errdefs.IsNotFound(err) {
			return fmt.Errorf("record the fork bound to %s: %w", key, err)
		}
		// The snapshot, or the root it showed, is gone: nothing is left to record.
		log.G(ctx).WithError(err).WithField("key", key).Warn("a bind's records were never written and their subject is gone")
	}
	s.records.mu.Lock()
	delete(s.records.unrecorded, key)
	s.records.mu.Unlock()
	return nil
}

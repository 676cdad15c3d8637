package snapshotter

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs"
	bolt "go.etcd.io/bbolt"
)

// The metastore's bolt layout (containerd core/snapshots/storage), which Rekey edits
// directly because the storage package has no rename.
var (
	boltV1        = []byte("v1")
	boltSnapshots = []byte("snapshots")
	boltParents   = []byte("parents")
	boltID        = []byte("id")
)

// Rekey gives the snapshot named to the data of the snapshot from, and from the data
// of to: the two keys swap their ids (hence their directories and fork views) and
// their labels. Both must be active children of one parent. A warm pool uses it when
// a container adopts a pre-created member: the container's own, still empty,
// snapshot and the member's (mounted, in use) snapshot trade places, so that
// `ctr snapshot`, diff and the commit on remove all speak of what the task really
// runs on. Neither snapshot may be bound to a fork it committed to yet.
func (s *Snapshotter) Rekey(ctx context.Context, from, to string) error {
	first, second := from, to
	if second < first {
		first, second = second, first // lock in one order, whoever calls
	}
	s.locks.Lock(first)
	defer s.locks.Unlock(first)
	s.locks.Lock(second)
	defer s.locks.Unlock(second)
	if err := rekeyMeta(ctx, s.ms, from, to); err != nil {
		return err
	}
	// A pin follows the root it keeps alive, not the key.
	if _, info, err := s.get(ctx, to); err == nil {
		if b, ok, _ := s.parseBound(info); ok && b.isBound() {
			if err := s.forks.Pin(pinName(to), b.base); err != nil {
				return err
			}
			s.forks.Unpin(pinName(from))
		}
	}
	return nil
}

// rekeyMeta swaps the ids and labels of two active snapshots with one parent in the
// metastore, in one transaction, keeping containerd's parent index (which Remove
// consults) pointing at the right names.
func rekeyMeta(ctx context.Context, ms *storage.MetaStore, from, to string) error {
	tctx, t, err := ms.TransactionContext(ctx, true)
	if err != nil {
		return fmt.Errorf("rekey %s to %s: %w", from, to, err)
	}
	err = func(ctx context.Context) error {
		var infos [2]snapshots.Info
		for i, key := range []string{from, to} {
			_, info, _, err := storage.GetInfo(ctx, key)
			if err != nil {
				return fmt.Errorf("snapshot %s: %w", key, err)
			}
			if info.Kind != snapshots.KindActive {
				return fmt.Errorf("snapshot %s is not active: %w", key, errdefs.ErrFailedPrecondition)
			}
			infos[i] = info
		}
		if infos[0].Parent != infos[1].Parent {
			return fmt.Errorf("snapshots %s and %s have different parents (%q, %q): %w", from, to, infos[0].Parent, infos[1].Parent, errdefs.ErrFailedPrecondition)
		}
		// The storage package has no rename; its transaction is a bolt one.
		tx, ok := t.(*bolt.Tx)
		if !ok {
			return fmt.Errorf("metastore transaction is a %T, not a bolt transaction", t)
		}
		snaps := tx.Bucket(boltV1).Bucket(boltSnapshots)
		bFrom, bTo := snaps.Bucket([]byte(from)), snaps.Bucket([]byte(to))
		idFrom := append([]byte(nil), bFrom.Get(boltID)...)
		idTo := append([]byte(nil), bTo.Get(boltID)...)
		if err := bFrom.Put(boltID, idTo); err != nil {
			return err
		}
		if err := bTo.Put(boltID, idFrom); err != nil {
			return err
		}
		if p := infos[0].Parent; p != "" {
			pid, _ := binary.Uvarint(snaps.Bucket([]byte(p)).Get(boltID))
			parents := tx.Bucket(boltV1).Bucket(boltParents)
			for _, link := range []struct {
				id   []byte
				name string
			}{{idFrom, to}, {idTo, from}} {
				child, _ := binary.Uvarint(link.id)
				if err := parents.Put(parentLink(pid, child), []byte(link.name)); err != nil {
					return err
				}
			}
		}
		for i, key := range []string{to, from} {
			if _, err := storage.UpdateInfo(ctx, snapshots.Info{Name: key, Labels: infos[i].Labels}, "labels"); err != nil {
				return err
			}
		}
		return nil
	}(tctx)
	if err != nil {
		t.Rollback()
		return fmt.Errorf("rekey %s to %s: %w", from, to, err)
	}
	if err := t.Commit(); err != nil {
		return fmt.Errorf("rekey %s to %s: %w", from, to, err)
	}
	return nil
}

// parentLink is the metastore's parent index key: both ids as uvarints, separated by
// a zero byte.
func parentLink(parent, child uint64) []byte {
	b := make([]byte, 2*binary.MaxVarintLen64+1)
	i := binary.PutUvarint(b, parent)
	j := binary.PutUvarint(b[i+1:], child)
	return b[:i+j+1]
}

// CheckLateBind says whether a snapshot can still take a fork: prepared late-bound,
// not bound yet, and its view served here and not looked at before binding.
func (s *Snapshotter) CheckLateBind(ctx context.Context, key string) error {
	sn, info, err := s.get(ctx, key)
	if err != nil {
		return err
	}
	b, ok, err := s.parseBound(info)
	switch {
	case err != nil:
		return err
	case !ok || !b.spec.LateBind:
		return fmt.Errorf("snapshot %s was not prepared late-bound: %w", key, errdefs.ErrFailedPrecondition)
	case b.isBound():
		return fmt.Errorf("snapshot %s is bound already: %w", key, errdefs.ErrFailedPrecondition)
	}
	if b.spec.Slot {
		switch bound, present, err := s.slotBound(sn.ID); {
		case err != nil:
			return err
		case !present:
			return fmt.Errorf("the slot of snapshot %s is not mounted: %w", key, errdefs.ErrFailedPrecondition)
		case bound:
			return fmt.Errorf("a view is mounted onto the slot of snapshot %s already: %w", key, errdefs.ErrFailedPrecondition)
		}
		return nil
	}
	dir := s.viewDir(sn.ID)
	if !s.views.Mounted(ctx, dir) {
		return fmt.Errorf("the view of snapshot %s is not served: %w", key, errdefs.ErrFailedPrecondition)
	}
	if tainted, err := s.views.Tainted(dir); err != nil || tainted {
		return fmt.Errorf("the workdir of snapshot %s was looked up before binding: %w", key, errdefs.ErrFailedPrecondition)
	}
	return nil
}

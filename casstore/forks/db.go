package forks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/containerd/errdefs"
	bolt "go.etcd.io/bbolt"
	boltErrors "go.etcd.io/bbolt/errors"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/internal/groupcommit"
)

var (
	bucketForks = []byte("forks")
	bucketPins  = []byte("pins")
	// bucketRequests maps a create's request id to the fork it made.
	bucketRequests = []byte("requests")
)

// ErrLocked says another process (normally tidepoold) holds the database open.
var ErrLocked = errors.New("fork database is in use by another process")

// DB is the bbolt-backed fork store. bbolt allows one process at a time, which is why
// the CLI talks to tidepoold's API while the daemon runs.
type DB struct {
	db    *bolt.DB
	now   func() time.Time
	guard Guard
	// pins commits concurrent pins and unpins together (a burst of claims pins one
	// root each): see groupcommit.
	pins *groupcommit.Group[*bolt.Tx]
}

// Guard keeps garbage collection from sweeping while a record that names a root is
// written, and says whether the root is stored. *casstore.Store implements it.
type Guard interface {
	Hold() (release func(), err error)
	Has(h casstore.Hash) (bool, error)
}

// SetGuard makes every record that names a root (Create, Advance, Pin) check, under
// g's lock, that the root is stored before it is written. Garbage collection reads
// the live roots under the same lock exclusively, so a root is either recorded
// before a collection looks, or already swept and refused here: a record never
// names a collected root. Without a guard nothing is checked (tests, tools).
func (d *DB) SetGuard(g Guard) { d.guard = g }

// ErrRootGone says a record would name a root that is not in the store (never
// stored, or collected before the record was written).
var ErrRootGone = fmt.Errorf("root is not in the store: %w", errdefs.ErrNotFound)

// guarded runs write under the guard's lock after checking that root is stored.
func (d *DB) guarded(root casstore.Hash, write func() error) error {
	if d.guard == nil {
		return write()
	}
	release, err := d.guard.Hold()
	if err != nil {
		return err
	}
	defer release()
	if root != casstore.EmptyHash {
		ok, err := d.guard.Has(root)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%s: %w (garbage collection may have removed it: store it again)", root, ErrRootGone)
		}
	}
	return write()
}

var _ Service = (*DB)(nil)

// OpenDB opens (creating if needed) the database at path, waiting at most timeout for
// another process to let go of it.
func OpenDB(path string, timeout time.Duration) (*DB, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("open fork database: %w", err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: timeout})
	if err != nil {
		if errors.Is(err, boltErrors.ErrTimeout) {
			return nil, fmt.Errorf("%s: %w", path, ErrLocked)
		}
		return nil, fmt.Errorf("open fork database %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketForks, bucketPins, bucketRequests} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init fork database %s: %w", path, err)
	}
	return &DB{db: db, now: time.Now, pins: &groupcommit.Group[*bolt.Tx]{Commit: func(apply func(*bolt.Tx) error) error {
		return db.Update(apply)
	}}}, nil
}

// Close releases the database.
func (d *DB) Close() error { return d.db.Close() }

func getFork(tx *bolt.Tx, id string) (*Fork, error) {
	v := tx.Bucket(bucketForks).Get([]byte(id))
	if v == nil {
		return nil, notFound(id)
	}
	var f Fork
	if err := json.Unmarshal(v, &f); err != nil {
		return nil, fmt.Errorf("fork %s: corrupt record: %w", id, err)
	}
	return &f, nil
}

func putFork(tx *bolt.Tx, f *Fork) error {
	v, err := json.Marshal(f)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketForks).Put([]byte(f.ID), v)
}

// Create writes one record: O(1) whatever the size of the tree. With a request id
// that an earlier create already used, it returns that create's fork (same base
// required) and writes nothing.
func (d *DB) Create(_ context.Context, req CreateRequest) (*Fork, error) {
	f, err := d.newFork(req, casstore.Hash{}, "")
	if err != nil {
		return nil, fmt.Errorf("create fork: %w", err)
	}
	err = d.guarded(req.Base, func() error {
		return d.db.Update(func(tx *bolt.Tx) error { return insertFork(tx, &f) })
	})
	if err != nil {
		return nil, fmt.Errorf("create fork: %w", err)
	}
	return f, nil
}

// CreateAt makes one fork per request in a single transaction, each based on its
// request's Base and already advanced to root, with Base in its history under
// reason: branches of a container's work, which started at Base and reached root.
// Request ids dedup as in Create. Nothing is written unless every fork is.
func (d *DB) CreateAt(_ context.Context, reqs []CreateRequest, root casstore.Hash, reason string) ([]*Fork, error) {
	if root.IsZero() {
		return nil, fmt.Errorf("create forks: no root: %w", errdefs.ErrInvalidArgument)
	}
	out := make([]*Fork, len(reqs))
	for i, req := range reqs {
		f, err := d.newFork(req, root, reason)
		if err != nil {
			return nil, fmt.Errorf("create fork %d: %w", i+1, err)
		}
		out[i] = f
	}
	err := d.guarded(root, func() error {
		return d.db.Update(func(tx *bolt.Tx) error {
			for i := range out {
				if err := insertFork(tx, &out[i]); err != nil {
					return err
				}
			}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("create forks: %w", err)
	}
	return out, nil
}

// newFork checks req and builds its record; a non-zero root starts the fork there,
// with its base as the first revision.
func (d *DB) newFork(req CreateRequest, root casstore.Hash, reason string) (*Fork, error) {
	if req.TTL < 0 {
		return nil, fmt.Errorf("fork ttl %s is negative: %w", req.TTL, errdefs.ErrInvalidArgument)
	}
	if req.Base.IsZero() {
		return nil, fmt.Errorf("fork needs a base root: %w", errdefs.ErrInvalidArgument)
	}
	rid, err := req.requestID()
	if err != nil {
		return nil, err
	}
	labels := req.Labels
	if rid != "" && labels[RequestIDLabel] == "" {
		labels = make(map[string]string, len(req.Labels)+1)
		for k, v := range req.Labels {
			labels[k] = v
		}
		labels[RequestIDLabel] = rid
	}
	now := d.now().UTC()
	f := &Fork{
		ID: NewID(), Label: req.Label, Base: req.Base, Root: req.Base,
		Created: now, Updated: now, TTL: Duration(req.TTL), Labels: labels,
	}
	if !root.IsZero() && root != req.Base {
		f.History = []Revision{{Root: req.Base, Time: now, Reason: reason}}
		f.Root = root
	}
	return f, nil
}

// insertFork writes *f, or replaces *f with the fork an earlier create with the same
// request id made (which must have the same base).
func insertFork(tx *bolt.Tx, f **Fork) error {
	nf := *f
	if rid := nf.Labels[RequestIDLabel]; rid != "" {
		if id := tx.Bucket(bucketRequests).Get([]byte(rid)); id != nil {
			prev, err := getFork(tx, string(id))
			if err != nil {
				return fmt.Errorf("request %s already made fork %s, which no longer exists: %w", rid, id, errdefs.ErrAlreadyExists)
			}
			if prev.Base != nf.Base {
				return fmt.Errorf("request %s already made fork %s of another base (%s): %w", rid, id, prev.Base.Short(), errdefs.ErrAlreadyExists)
			}
			*f = prev
			return nil
		}
		if err := tx.Bucket(bucketRequests).Put([]byte(rid), []byte(nf.ID)); err != nil {
			return err
		}
	}
	if tx.Bucket(bucketForks).Get([]byte(nf.ID)) != nil {
		return fmt.Errorf("fork id collision %s: %w", nf.ID, errdefs.ErrAlreadyExists)
	}
	return putFork(tx, nf)
}

// forgetRequest drops the request id index entry of a fork being removed.
func forgetRequest(tx *bolt.Tx, id []byte) {
	v := tx.Bucket(bucketForks).Get(id)
	if v == nil {
		return
	}
	var f Fork
	if json.Unmarshal(v, &f) != nil {
		return
	}
	if rid := f.Labels[RequestIDLabel]; rid != "" {
		if got := tx.Bucket(bucketRequests).Get([]byte(rid)); string(got) == string(id) {
			_ = tx.Bucket(bucketRequests).Delete([]byte(rid))
		}
	}
}

// Get finds a fork by id, then by label.
func (d *DB) Get(_ context.Context, ref string) (*Fork, error) {
	if ref == "" {
		// Unlabelled forks have the label "": an empty ref must not find one of them.
		return nil, notFound(ref)
	}
	var out *Fork
	err := d.db.View(func(tx *bolt.Tx) error {
		if f, err := getFork(tx, ref); err == nil {
			out = f
			return nil
		} else if !errdefs.IsNotFound(err) {
			return err
		}
		var matches []*Fork
		err := tx.Bucket(bucketForks).ForEach(func(k, v []byte) error {
			var f Fork
			if json.Unmarshal(v, &f) == nil && f.Label == ref {
				matches = append(matches, &f)
			}
			return nil
		})
		if err != nil {
			return err
		}
		switch len(matches) {
		case 0:
			return notFound(ref)
		case 1:
			out = matches[0]
			return nil
		default:
			return fmt.Errorf("label %q names %d forks; use a fork id: %w", ref, len(matches), errdefs.ErrInvalidArgument)
		}
	})
	return out, err
}

// List returns every fork, oldest first.
func (d *DB) List(context.Context) ([]*Fork, error) {
	var out []*Fork
	err := d.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketForks).ForEach(func(k, v []byte) error {
			var f Fork
			if err := json.Unmarshal(v, &f); err != nil {
				return fmt.Errorf("fork %s: corrupt record: %w", k, err)
			}
			out = append(out, &f)
			return nil
		})
	})
	sort.SliceStable(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, err
}

// Remove deletes a fork record. The objects it pointed at stay until GC.
func (d *DB) Remove(_ context.Context, id string) error {
	return d.db.Update(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketForks).Get([]byte(id)) == nil {
			return notFound(id)
		}
		forgetRequest(tx, []byte(id))
		return tx.Bucket(bucketForks).Delete([]byte(id))
	})
}

// Advance records a new root, pushing the old one onto the history.
func (d *DB) Advance(_ context.Context, id string, expect, newRoot casstore.Hash, reason string) (*Fork, error) {
	var out *Fork
	err := d.guarded(newRoot, func() error {
		return d.db.Update(func(tx *bolt.Tx) error {
			f, err := getFork(tx, id)
			if err != nil {
				return err
			}
			if !expect.IsZero() && f.Root != expect {
				return fmt.Errorf("fork %s is at %s, not %s: %w", id, f.Root.Short(), expect.Short(), ErrConflict)
			}
			now := d.now().UTC()
			if newRoot != f.Root {
				f.History = append(f.History, Revision{Root: f.Root, Time: f.Updated, Reason: reason})
				if n := len(f.History); n > HistoryLimit {
					f.History = append([]Revision(nil), f.History[n-HistoryLimit:]...)
				}
				f.Root = newRoot
			}
			f.Updated = now
			out = f
			return putFork(tx, f)
		})
	})
	if err != nil {
		return nil, fmt.Errorf("advance fork %s: %w", id, err)
	}
	return out, nil
}

// Sweep removes forks whose TTL has run out and returns their ids.
func (d *DB) Sweep(now time.Time) ([]string, error) {
	var gone []string
	err := d.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketForks)
		var expired [][]byte
		err := b.ForEach(func(k, v []byte) error {
			var f Fork
			if json.Unmarshal(v, &f) == nil && f.Expired(now) {
				expired = append(expired, append([]byte(nil), k...))
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range expired {
			forgetRequest(tx, k)
			if err := b.Delete(k); err != nil {
				return err
			}
			gone = append(gone, string(k))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("sweep expired forks: %w", err)
	}
	return gone, nil
}

// Pin keeps root alive through garbage collection under name until Unpin.
func (d *DB) Pin(name string, root casstore.Hash) error {
	if name == "" {
		return fmt.Errorf("pin needs a name: %w", errdefs.ErrInvalidArgument)
	}
	return d.guarded(root, func() error {
		return d.pins.Do(func(tx *bolt.Tx) error {
			return tx.Bucket(bucketPins).Put([]byte(name), root[:])
		})
	})
}

// Unpin drops a pin; unknown names are not an error.
func (d *DB) Unpin(name string) error {
	return d.pins.Do(func(tx *bolt.Tx) error { return tx.Bucket(bucketPins).Delete([]byte(name)) })
}

// Pins lists pins by name.
func (d *DB) Pins() (map[string]casstore.Hash, error) {
	out := map[string]casstore.Hash{}
	err := d.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketPins).ForEach(func(k, v []byte) error {
			var h casstore.Hash
			if len(v) != casstore.HashSize {
				return fmt.Errorf("pin %q: corrupt value", k)
			}
			copy(h[:], v)
			out[string(k)] = h
			return nil
		})
	})
	return out, err
}

// LiveRoots returns every root that garbage collection must keep: each fork's base,
// current root and history, and every pin.
func (d *DB) LiveRoots() ([]casstore.Hash, error) {
	seen := map[casstore.Hash]struct{}{}
	list, err := d.List(context.Background())
	if err != nil {
		return nil, err
	}
	for _, f := range list {
		seen[f.Base] = struct{}{}
		seen[f.Root] = struct{}{}
		for _, r := range f.History {
			seen[r.Root] = struct{}{}
		}
	}
	pins, err := d.Pins()
	if err != nil {
		return nil, err
	}
	for _, h := range pins {
		seen[h] = struct{}{}
	}
	out := make([]casstore.Hash, 0, len(seen))
	for h := range seen {
		out = append(out, h)
	}
	return out, nil
}

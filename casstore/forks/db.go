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
)

var (
	bucketForks = []byte("forks")
	bucketPins  = []byte("pins")
)

// ErrLocked says another process (normally tidepoold) holds the database open.
var ErrLocked = errors.New("fork database is in use by another process")

// DB is the bbolt-backed fork store. bbolt allows one process at a time, which is why
// the CLI talks to tidepoold's API while the daemon runs.
type DB struct {
	db  *bolt.DB
	now func() time.Time
}

var _ Service = (*DB)(nil)

// OpenDB opens (creating if needed) the database at path, waiting at most timeout for
// another process to let go of it.
func OpenDB(path string, timeout time.Duration) (*DB, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
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
		for _, b := range [][]byte{bucketForks, bucketPins} {
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
	return &DB{db: db, now: time.Now}, nil
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

// Create writes one record: O(1) whatever the size of the tree.
func (d *DB) Create(_ context.Context, req CreateRequest) (*Fork, error) {
	if req.TTL < 0 {
		return nil, fmt.Errorf("fork ttl %s is negative: %w", req.TTL, errdefs.ErrInvalidArgument)
	}
	if req.Base.IsZero() {
		return nil, fmt.Errorf("fork needs a base root: %w", errdefs.ErrInvalidArgument)
	}
	now := d.now().UTC()
	f := &Fork{
		ID: NewID(), Label: req.Label, Base: req.Base, Root: req.Base,
		Created: now, Updated: now, TTL: Duration(req.TTL), Labels: req.Labels,
	}
	err := d.db.Update(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketForks).Get([]byte(f.ID)) != nil {
			return fmt.Errorf("fork id collision %s: %w", f.ID, errdefs.ErrAlreadyExists)
		}
		return putFork(tx, f)
	})
	if err != nil {
		return nil, fmt.Errorf("create fork: %w", err)
	}
	return f, nil
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
		return tx.Bucket(bucketForks).Delete([]byte(id))
	})
}

// Advance records a new root, pushing the old one onto the history.
func (d *DB) Advance(_ context.Context, id string, expect, newRoot casstore.Hash, reason string) (*Fork, error) {
	var out *Fork
	err := d.db.Update(func(tx *bolt.Tx) error {
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
	return d.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketPins).Put([]byte(name), root[:])
	})
}

// Unpin drops a pin; unknown names are not an error.
func (d *DB) Unpin(name string) error {
	return d.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketPins).Delete([]byte(name)) })
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

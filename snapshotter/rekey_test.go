package snapshotter

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"strconv"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs"
	bolt "go.etcd.io/bbolt"
)

// metaState is what containerd's storage package reads back about one snapshot.
type metaState struct {
	ID       string
	Kind     snapshots.Kind
	Parent   string
	Labels   map[string]string
	ParentID []string
}

func readMeta(t *testing.T, ms *storage.MetaStore, keys ...string) (map[string]metaState, map[string]string) {
	t.Helper()
	out := map[string]metaState{}
	var ids map[string]string
	err := ms.WithTransaction(context.Background(), false, func(ctx context.Context) error {
		var err error
		if ids, err = storage.IDMap(ctx); err != nil {
			return err
		}
		for _, k := range keys {
			id, info, _, err := storage.GetInfo(ctx, k)
			if err != nil {
				return err
			}
			st := metaState{ID: id, Kind: info.Kind, Parent: info.Parent, Labels: info.Labels}
			if info.Kind == snapshots.KindActive {
				s, err := storage.GetSnapshot(ctx, k)
				if err != nil {
					return err
				}
				if s.ID != id {
					return errors.New("GetSnapshot and GetInfo disagree on " + k)
				}
				st.ParentID = s.ParentIDs
			}
			out[k] = st
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out, ids
}

// newMetaFile makes a metastore the way containerd's overlay snapshotter does (its
// storage package, its bolt schema): a committed layer and two active children, one
// a member's (labelled, with data) and one a container's.
func newMetaFile(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "metadata.db")
	ms, err := storage.NewMetaStore(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ms.Close()
	err = ms.WithTransaction(context.Background(), true, func(ctx context.Context) error {
		if _, err := storage.CreateSnapshot(ctx, snapshots.KindActive, "layer-active", ""); err != nil {
			return err
		}
		if _, err := storage.CommitActive(ctx, "layer-active", "layer", snapshots.Usage{Size: 10}); err != nil {
			return err
		}
		if _, err := storage.CreateSnapshot(ctx, snapshots.KindActive, "other-layer", ""); err != nil {
			return err
		}
		if _, err := storage.CreateSnapshot(ctx, snapshots.KindActive, "member", "layer",
			snapshots.WithLabels(map[string]string{LabelPrefixForTest + "latebind": "true"})); err != nil {
			return err
		}
		_, err := storage.CreateSnapshot(ctx, snapshots.KindActive, "container", "layer",
			snapshots.WithLabels(map[string]string{"containerd.io/gc.root": "x"}))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return path
}

const LabelPrefixForTest = "containerd.io/snapshot/tidepool."

// TestRekeyContainerdSchema: a metastore written by containerd's storage package is
// re-keyed, closed, reopened and read back by the same package: the two keys swapped
// ids and labels, kinds and parents are unchanged, the id map agrees, and the parent
// index still makes containerd refuse to remove the parent while either child lives
// and lets each child go.
func TestRekeyContainerdSchema(t *testing.T) {
	path := newMetaFile(t)
	ms, err := storage.NewMetaStore(path)
	if err != nil {
		t.Fatal(err)
	}
	before, _ := readMeta(t, ms, "member", "container", "layer")
	if err := rekeyMeta(context.Background(), ms, "member", "container"); err != nil {
		t.Fatal(err)
	}
	ms.Close()

	ms, err = storage.NewMetaStore(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ms.Close()
	after, ids := readMeta(t, ms, "member", "container", "layer")
	if after["container"].ID != before["member"].ID || after["member"].ID != before["container"].ID {
		t.Fatalf("ids not swapped: before %+v, after %+v", before, after)
	}
	if !reflect.DeepEqual(after["container"].Labels, before["member"].Labels) || !reflect.DeepEqual(after["member"].Labels, before["container"].Labels) {
		t.Fatalf("labels not swapped: before %+v, after %+v", before, after)
	}
	for _, k := range []string{"member", "container"} {
		if after[k].Kind != snapshots.KindActive || after[k].Parent != "layer" || !reflect.DeepEqual(after[k].ParentID, before[k].ParentID) {
			t.Fatalf("%s changed kind or parent: %+v -> %+v", k, before[k], after[k])
		}
	}
	if !reflect.DeepEqual(after["layer"], before["layer"]) {
		t.Fatalf("the parent changed: %+v -> %+v", before["layer"], after["layer"])
	}
	if ids[after["container"].ID] != "container" || ids[after["member"].ID] != "member" {
		t.Fatalf("id map %v", ids)
	}
	// The parent index names each child by its key, as CreateSnapshot wrote it.
	_, tr, err := ms.TransactionContext(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	err = tr.(*bolt.Tx).Bucket(boltV1).Bucket(boltParents).ForEach(func(k, v []byte) error {
		i := bytes.IndexByte(k, 0)
		child, _ := binary.Uvarint(k[i+1:])
		if got := ids[strconv.FormatUint(child, 10)]; got != string(v) {
			return fmt.Errorf("parent index names child %d %q; it is %q", child, v, got)
		}
		return nil
	})
	tr.Rollback()
	if err != nil {
		t.Fatal(err)
	}
	// containerd's Remove walks the parent index.
	remove := func(key string) error {
		return ms.WithTransaction(context.Background(), true, func(ctx context.Context) error {
			_, _, err := storage.Remove(ctx, key)
			return err
		})
	}
	if err := remove("layer"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("removing the parent of two children: %v", err)
	}
	if err := remove("container"); err != nil {
		t.Fatal(err)
	}
	if err := remove("layer"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("removing the parent of one child: %v", err)
	}
	if err := remove("member"); err != nil {
		t.Fatal(err)
	}
	if err := remove("layer"); err != nil {
		t.Fatalf("removing the parent once its children are gone: %v", err)
	}
}

// TestRekeyRefuses: snapshots that are not both active children of one parent are
// left exactly as they were.
func TestRekeyRefuses(t *testing.T) {
	path := newMetaFile(t)
	ms, err := storage.NewMetaStore(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ms.Close()
	keys := []string{"member", "container", "layer", "other-layer"}
	before, _ := readMeta(t, ms, keys...)
	for _, tc := range [][2]string{{"member", "layer"}, {"member", "other-layer"}, {"member", "missing"}} {
		err := rekeyMeta(context.Background(), ms, tc[0], tc[1])
		if err == nil || !(errdefs.IsFailedPrecondition(err) || errdefs.IsNotFound(err) || errors.Is(err, errdefs.ErrNotFound)) {
			t.Fatalf("rekey %s to %s: %v", tc[0], tc[1], err)
		}
		if after, _ := readMeta(t, ms, keys...); !reflect.DeepEqual(after, before) {
			t.Fatalf("a refused rekey %v changed the metastore: %+v -> %+v", tc, before, after)
		}
	}
}

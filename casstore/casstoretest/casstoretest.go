// Package casstoretest builds test stores, objects and trees for the tests of the
// store's sibling packages (checkout, fsck, gc, ingest, treediff), so they all build
// their fixtures one way instead of each keeping its own copy of the same helpers.
// Every helper fails the test on an error; Stage alone returns its error, so that
// goroutines, which must not call t.Fatal, can use it.
package casstoretest

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
)

// NewStore opens an empty store in a temporary directory the test removes.
func NewStore(t testing.TB) *casstore.Store {
	t.Helper()
	s, err := casstore.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Settle) // journaled batches settle before the temp dir goes
	return s
}

// Put stores data as one object and returns its hash.
func Put(t testing.TB, s *casstore.Store, data string) casstore.Hash {
	t.Helper()
	h, err := s.PutBytes([]byte(data))
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// Tree stores a tree of the given entries, through the codec's checks, and returns
// its hash.
func Tree(t testing.TB, s *casstore.Store, ents ...casstore.Entry) casstore.Hash {
	t.Helper()
	h, err := s.WriteTree(ents)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// RawTree encodes entries in the tree format without the codec's checks (in the
// order given, any names), as LunarFS or a hostile or buggy writer could, stores the
// bytes and returns their hash. Tests use it for trees Tidepool must refuse or route
// around.
func RawTree(t testing.TB, s *casstore.Store, ents ...casstore.Entry) casstore.Hash {
	t.Helper()
	var b []byte
	for _, e := range ents {
		b = binary.LittleEndian.AppendUint32(b, uint32(e.Mode))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(e.Name)))
		b = append(b, e.Name...)
		b = append(b, e.Hash[:]...)
	}
	return Put(t, s, string(b))
}

// Roots is a fixed set of live roots, standing in for the fork database where gc
// and fsck ask for the roots to keep or check.
type Roots []casstore.Hash

// LiveRoots returns the set itself.
func (r Roots) LiveRoots() ([]casstore.Hash, error) { return r, nil }

// Leaf is one non-directory entry of a test tree (its mode and its content or link
// target), or an empty directory.
type Leaf struct {
	Mode casstore.Mode
	Data string
}

// File is a regular, non-executable file holding data.
func File(data string) Leaf { return Leaf{casstore.ModeFile, data} }

// Exec is an executable file holding data.
func Exec(data string) Leaf { return Leaf{casstore.ModeExec, data} }

// Link is a symlink to target.
func Link(target string) Leaf { return Leaf{casstore.ModeSymlink, target} }

// EmptyDir is an empty directory; a directory with content needs no leaf of its own.
func EmptyDir() Leaf { return Leaf{Mode: casstore.ModeDir} }

// Files describes a tree of regular files (path -> content) as leaves.
func Files(files map[string]string) map[string]Leaf {
	out := make(map[string]Leaf, len(files))
	for p, data := range files {
		out[p] = File(data)
	}
	return out
}

// Build stores the tree described by leaves ('/'-separated path -> leaf; the
// directories on the way are implied) in one batch and returns its root. A nil or
// empty map gives the empty tree.
func Build(t testing.TB, s *casstore.Store, leaves map[string]Leaf) casstore.Hash {
	t.Helper()
	b, err := s.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Abort()
	h, err := Stage(b, leaves)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	return h
}

// Stage writes the tree described by leaves into b, as Build does, and returns its
// root. It takes no testing.TB, so it is safe to call from any goroutine.
func Stage(b *casstore.Batch, leaves map[string]Leaf) (casstore.Hash, error) {
	sub := map[string]map[string]Leaf{}
	var ents []casstore.Entry
	for p, l := range leaves {
		dir, rest, nested := strings.Cut(p, "/")
		switch {
		case nested:
			if sub[dir] == nil {
				sub[dir] = map[string]Leaf{}
			}
			sub[dir][rest] = l
		case l.Mode == casstore.ModeDir:
			if sub[p] == nil {
				sub[p] = map[string]Leaf{}
			}
		default:
			h, err := b.PutBytes([]byte(l.Data))
			if err != nil {
				return h, err
			}
			ents = append(ents, casstore.Entry{Mode: l.Mode, Name: p, Hash: h})
		}
	}
	for name, m := range sub {
		h, err := Stage(b, m)
		if err != nil {
			return h, err
		}
		ents = append(ents, casstore.Entry{Mode: casstore.ModeDir, Name: name, Hash: h})
	}
	return b.WriteTree(ents)
}

// DeadJournal writes objects of src into a journal of dst whose writer no longer
// runs (the store's journal format: "TPJRNL1\n", then per object its hash, its
// length as a big-endian uint64 and its bytes): what a pull or a branch killed
// before its objects reached their names leaves. Readers of dst must find them there.
func DeadJournal(t testing.TB, dst, src *casstore.Store, objects ...casstore.Hash) {
	t.Helper()
	buf := []byte("TPJRNL1\n")
	for _, h := range objects {
		data, err := src.ReadAll(h, 1<<30)
		if err != nil {
			t.Fatal(err)
		}
		buf = append(buf, h[:]...)
		buf = binary.BigEndian.AppendUint64(buf, uint64(len(data)))
		buf = append(buf, data...)
	}
	dir := filepath.Join(dst.Root(), ".tidepool-tmp", "journal")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "jnl-999999999.1-test"), buf, 0o600); err != nil {
		t.Fatal(err)
	}
}

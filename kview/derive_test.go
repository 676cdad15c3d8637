package kview

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// imageAndSlots writes tr's image for its spec's owner and returns it with its owner
// slots.
func imageAndSlots(t *testing.T, tr *Tree) (img, slots []byte) {
	t.Helper()
	var b bytes.Buffer
	l, err := tr.writeImage(&b, &scratch{})
	if err != nil {
		t.Fatal(err)
	}
	return b.Bytes(), l.ownerSlots()
}

// TestDeriveImageMatchesBuild: an image derived for another owner of the same class
// is byte for byte the image built for that owner, for random trees reaching every
// layout rule (with and without a prefix, files needing extended inodes whatever
// their owner); owners of different classes are refused.
func TestDeriveImageMatchesBuild(t *testing.T) {
	owners := [][2]uint32{{0, 0}, {1000, 1000}, {65535, 7}, {70000, 5}, {1 << 31, 1 << 30}}
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 6 { // seeds 0 (root-owned), 1 and 4 (a prefix)
		tr := randomTree(rng, i)
		keepOneHugeFile(tr.top, new(bool))
		imgs, slots := make([][]byte, len(owners)), make([][]byte, len(owners))
		for k, o := range owners {
			tr.spec.UID, tr.spec.GID = o[0], o[1]
			imgs[k], slots[k] = imageAndSlots(t, tr)
		}
		for f, from := range owners {
			for k, to := range owners {
				got := bytes.Clone(imgs[f])
				err := deriveImage(got, slots[f], from[0], from[1], to[0], to[1])
				what := fmt.Sprintf("tree %d, %d:%d -> %d:%d", i, from[0], from[1], to[0], to[1])
				if ownerFits16(from[0], from[1]) != ownerFits16(to[0], to[1]) {
					if !errors.Is(err, errOwnerClass) {
						t.Fatalf("%s: %v, want errOwnerClass", what, err)
					}
					continue
				}
				if err != nil {
					t.Fatalf("%s: %v", what, err)
				}
				if !bytes.Equal(got, imgs[k]) {
					t.Fatalf("%s: the derived image differs from the built one", what)
				}
			}
		}
	}
}

// keepOneHugeFile shrinks every file over 4 GiB but the first (each costs its image
// 10 MiB of chunk indexes): one is enough to have an extended inode whatever the owner.
func keepOneHugeFile(n *node, seen *bool) {
	if n.size > 0xffffffff {
		if *seen {
			n.size = 1 << 20
		}
		*seen = true
	}
	for _, c := range n.children {
		keepOneHugeFile(c, seen)
	}
}

// TestDeriveImageRefusesBadSlots: slots that do not describe the image (another
// owner, another format, out of range, torn) are refused.
func TestDeriveImageRefusesBadSlots(t *testing.T) {
	tr := randomTree(rand.New(rand.NewPCG(5, 6)), 1)
	tr.spec.UID, tr.spec.GID = 1000, 1000
	img, slots := imageAndSlots(t, tr)
	if len(slots) < 16 {
		t.Fatalf("only %d owner slots", len(slots)/8)
	}
	le := binary.LittleEndian
	for name, c := range map[string]struct {
		slots          []byte
		fromUID, fromG uint32
	}{
		"another owner":  {slots, 1001, 1000},
		"torn":           {slots[:len(slots)-3], 1000, 1000},
		"out of range":   {le.AppendUint64(nil, uint64(len(img))), 1000, 1000},
		"another format": {le.AppendUint64(nil, le.Uint64(slots)&^slotCompact), 1000, 1000},
		"misaligned":     {le.AppendUint64(nil, le.Uint64(slots)+8), 1000, 1000},
	} {
		if err := deriveImage(bytes.Clone(img), c.slots, c.fromUID, c.fromG, 2000, 2000); err == nil {
			t.Errorf("%s: derived", name)
		}
	}
}

// TestCacheDerivesOtherOwners: the cache builds a tree's first image from a scan and
// derives the images of other owners of the same class from it (and after a restart,
// from the images a previous process left), each the image a scan would build;
// another class, or a cached image without its owner slots, is built; a derivation
// checks the tree's objects as a build does.
func TestCacheDerivesOtherOwners(t *testing.T) {
	ctx := context.Background()
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	dir := t.TempDir()
	c := openCache(t, dir, s)
	image := func(c *Cache, spec Spec) {
		t.Helper()
		img, err := c.image(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		if want := buildImage(t, s, spec); !bytes.Equal(got, want) {
			t.Fatalf("image of %+v differs from a build's", spec)
		}
	}
	counts := func(c *Cache, builds, derived int64) {
		t.Helper()
		if b, d := c.stats.Builds.Load(), c.stats.Derived.Load(); b != builds || d != derived {
			t.Fatalf("%d built, %d derived; want %d and %d", b, d, builds, derived)
		}
	}
	spec := func(uid, gid uint32) Spec { return Spec{Root: root, Prefix: "srv/app", UID: uid, GID: gid} }
	image(c, spec(1000, 1000))
	counts(c, 1, 0)
	image(c, spec(0, 0))
	image(c, spec(501, 20))
	counts(c, 1, 2)
	image(c, spec(70000, 70000)) // extended inodes: another layout
	counts(c, 2, 2)
	image(c, spec(100000, 3))
	counts(c, 2, 3)
	image(c, Spec{Root: root, UID: 1000, GID: 1000}) // another prefix: another tree
	counts(c, 3, 3)

	// A new process finds the images of the previous one.
	c2 := openCache(t, dir, s)
	image(c2, spec(42, 42))
	counts(c2, 0, 1)

	// Images without owner slots (another binary's) are never derived from.
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".owners") {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
	c3 := openCache(t, dir, s)
	image(c3, spec(43, 43))
	counts(c3, 1, 0)
	image(c3, spec(44, 44)) // from the image just built, which has its slots
	counts(c3, 1, 1)

	// A derivation checks the objects: one gone is a MissingError naming it.
	tr, err := Scan(ctx, s, spec(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	gone := tr.objects[0]
	removeObject(t, s, gone)
	_, err = c3.image(ctx, spec(45, 45))
	var miss *MissingError
	if !errors.As(err, &miss) || len(miss.Objects) != 1 || miss.Objects[0] != gone {
		t.Fatalf("derivation with an object gone: %v", err)
	}
	counts(c3, 1, 1)
}

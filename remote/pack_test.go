package remote_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/minio/minio-go/v7"
	"github.com/pierrec/lz4/v4"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

type packHead struct {
	root, base casstore.Hash
	count      uint64
}

// parsePack decodes a pack by its documented format (pack.go), independently of the
// code that writes it: header, then hash, size, stored length and bytes per entry
// (one LZ4 block when shorter than the size), nothing after. It returns the objects'
// bytes, decoded.
func parsePack(t *testing.T, b []byte) (packHead, map[casstore.Hash][]byte) {
	t.Helper()
	var h packHead
	if len(b) < 88 || string(b[:8]) != "TIDEPACK" || binary.BigEndian.Uint32(b[8:]) != 2 || binary.BigEndian.Uint32(b[12:]) != 0 {
		t.Fatalf("pack header %q is not TIDEPACK version 2", b[:min(len(b), 16)])
	}
	copy(h.root[:], b[16:48])
	copy(h.base[:], b[48:80])
	h.count = binary.BigEndian.Uint64(b[80:88])
	ents := map[casstore.Hash][]byte{}
	rest := b[88:]
	for i := uint64(0); i < h.count; i++ {
		if len(rest) < 48 {
			t.Fatalf("pack entry %d: short header", i)
		}
		var eh casstore.Hash
		copy(eh[:], rest[:32])
		size := binary.BigEndian.Uint64(rest[32:40])
		stored := binary.BigEndian.Uint64(rest[40:48])
		if uint64(len(rest)-48) < stored || stored > size {
			t.Fatalf("pack entry %d: %d stored bytes for %d, %d left", i, stored, size, len(rest)-48)
		}
		body := rest[48 : 48+stored]
		if stored < size {
			dec := make([]byte, size)
			n, err := lz4.UncompressBlock(body, dec)
			if err != nil || uint64(n) != size {
				t.Fatalf("pack entry %s: compressed bytes decode to %d bytes, %v; want %d", eh, n, err, size)
			}
			body = dec
		}
		if casstore.Sum(body) != eh {
			t.Fatalf("pack entry %s does not hash to its name", eh)
		}
		if _, dup := ents[eh]; dup {
			t.Fatalf("pack entry %s twice", eh)
		}
		ents[eh] = body
		rest = rest[48+stored:]
	}
	if len(rest) != 0 {
		t.Fatalf("%d bytes after the last pack entry", len(rest))
	}
	return h, ents
}

func getRaw(t *testing.T, srv *s3test.Server, key string) []byte {
	t.Helper()
	obj, err := srv.Client(t).GetObject(context.Background(), srv.Bucket, key, minio.GetObjectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer obj.Close()
	b, err := io.ReadAll(obj)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return b
}

func hasKey(t *testing.T, srv *s3test.Server, key string) bool {
	t.Helper()
	_, err := srv.Client(t).StatObject(context.Background(), srv.Bucket, key, minio.StatObjectOptions{})
	return err == nil
}

// TestPackRoundTrip: a push writes its pack (exactly what it uploaded, parents
// first), a pull into an empty store reads the whole root from it with one request,
// and a pull of a later commit follows the pack's base to the first push's pack.
func TestPackRoundTrip(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	dir, r0 := bigTree(t, a, 300, 500)
	r := openRemote(t, srv, 8)
	full, err := r.Push(ctx, a, r0, remote.PushOptions{Ref: "main"})
	if err != nil {
		t.Fatal(err)
	}
	head, ents := parsePack(t, getRaw(t, srv, r.PackKey(r0)))
	all := reachable(t, a, r0)
	if head.root != r0 || !head.base.IsZero() || len(ents) != len(all) || int64(len(ents)) != full.Objects {
		t.Fatalf("pack of the first push: root %s base %s, %d entries; want %s, none, %d", head.root, head.base, len(ents), r0, len(all))
	}
	if st := r.Metrics().Snapshot(); st.PacksPushed != 1 {
		t.Fatalf("packs pushed = %d, want 1", st.PacksPushed)
	}

	b := newStore(t)
	pr, err := openRemote(t, srv, 8).Pull(ctx, b, r0)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Packs != 1 || pr.Requests != 1 || pr.Objects != int64(len(all)) {
		t.Fatalf("pull into an empty store: %+v; want the %d objects from one pack with 1 request", pr, len(all))
	}
	checkComplete(t, b, r0)

	// A commit that changed three files: its pack holds just the new objects and
	// names r0 as its base.
	writeFiles(t, dir, map[string]string{"d01/e01/f0001": "one", "d02/e02/f0002": "two", "new/file": "three"})
	r1 := ingestDir(t, a, dir)
	small, err := r.Push(ctx, a, r1, remote.PushOptions{Ref: "main", Expect: &r0})
	if err != nil {
		t.Fatal(err)
	}
	head, ents = parsePack(t, getRaw(t, srv, r.PackKey(r1)))
	if head.base != r0 || int64(len(ents)) != small.Objects {
		t.Fatalf("pack of the commit: base %s, %d entries; want base %s and the %d uploaded", head.base, len(ents), r0, small.Objects)
	}
	for h := range ents {
		if all[h] {
			t.Fatalf("pack of the commit holds %s, already in the bucket before it", h)
		}
	}
	// A host that has r0 reads only the commit's pack.
	pr, err = openRemote(t, srv, 8).Pull(ctx, b, r1)
	if err != nil || pr.Packs != 1 || pr.Requests != 1 || pr.Objects != small.Objects {
		t.Fatalf("pull of the commit over r0: %+v, %v; want its %d objects from 1 pack", pr, err, small.Objects)
	}
	checkComplete(t, b, r1)
	// An empty host follows the base: two packs, two requests.
	c := newStore(t)
	pr, err = openRemote(t, srv, 8).Pull(ctx, c, r1)
	if err != nil || pr.Packs != 2 || pr.Requests != 2 {
		t.Fatalf("pull of the commit into an empty store: %+v, %v; want 2 packs, 2 requests", pr, err)
	}
	checkComplete(t, c, r1)
	if n := len(reachable(t, c, r1)); pr.Objects != int64(n) {
		t.Fatalf("pulled %d objects, want the %d of r1 (nothing of r0 only)", pr.Objects, n)
	}
}

// rewritePack replaces the pack of root in the bucket with edit(pack).
func rewritePack(t *testing.T, srv *s3test.Server, r *remote.Remote, root casstore.Hash, edit func([]byte) []byte) {
	t.Helper()
	putRaw(t, srv, r.PackKey(root), edit(getRaw(t, srv, r.PackKey(root))))
}

// TestPackCorruptEntry: a pack entry whose bytes do not hash to its name is refused
// and counted, never stored; the object is fetched on its own and the pull completes.
func TestPackCorruptEntry(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	_, root := sample(t, a)
	r := openRemote(t, srv, 4)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	victim := casstore.Sum([]byte("deep\n"))
	var evil []byte
	rewritePack(t, srv, r, root, func(b []byte) []byte {
		i := strings.Index(string(b), "deep\n")
		if i < 0 || string(b[i-48:i-16]) != string(victim[:]) {
			t.Fatal("entry not found in the pack")
		}
		b[i] = 'D'
		evil = []byte("Deep\n")
		return b
	})
	b := newStore(t)
	rr := openRemote(t, srv, 4)
	pr, err := rr.Pull(ctx, b, root)
	if err != nil {
		t.Fatalf("pull over a pack with a corrupt entry: %v", err)
	}
	// The pull's journal, not settled yet, holds the good entries only.
	js, err := b.Journals()
	if err != nil || len(js) != 1 {
		t.Fatalf("journals right after the pull: %v, %v; want the pull's", js, err)
	}
	if raw, err := os.ReadFile(js[0].Path); err != nil || !bytes.Contains(raw, []byte("shared\n")) || bytes.Contains(raw, evil) {
		t.Fatalf("journal %s (%v): holds the corrupt entry or not the good ones", js[0].Path, err)
	}
	if pr.Packs != 1 || pr.Requests != 2 {
		t.Fatalf("pull: %s; want the pack read to its end and one GET for the refused object", srvMetrics(pr))
	}
	if m := rr.Metrics().Snapshot(); m.VerifyFailures != 1 || m.PackFailures != 0 {
		t.Fatalf("metrics %+v: want 1 verify failure, no pack failure", m)
	}
	checkComplete(t, b, root)
	if ok, _ := b.Has(casstore.Sum(evil)); ok {
		t.Fatal("the corrupt entry's bytes were stored")
	}
}

// compressibleTree ingests 40 files that compress well and 10 of random bytes.
func compressibleTree(t *testing.T, s *casstore.Store) casstore.Hash {
	dir := t.TempDir()
	files := map[string]string{}
	for i := 0; i < 40; i++ {
		files[fmt.Sprintf("src/f%02d.go", i)] = strings.Repeat(fmt.Sprintf("func f%d() { return %d }\n", i, i), 200)
	}
	for i := 0; i < 10; i++ {
		b := make([]byte, 5000)
		rand.Read(b)
		files[fmt.Sprintf("bin/r%02d", i)] = string(b)
	}
	writeFiles(t, dir, files)
	return ingestDir(t, s, dir)
}

// packEntries lists a pack's entries (version 2) as name, size and stored length.
func packEntries(t *testing.T, b []byte) map[casstore.Hash][2]uint64 {
	t.Helper()
	parsePack(t, b) // checks the framing and every entry
	out := map[casstore.Hash][2]uint64{}
	rest := b[88:]
	for len(rest) > 0 {
		var h casstore.Hash
		copy(h[:], rest[:32])
		size, stored := binary.BigEndian.Uint64(rest[32:]), binary.BigEndian.Uint64(rest[40:])
		out[h] = [2]uint64{size, stored}
		rest = rest[48+stored:]
	}
	return out
}

// TestPackCompressedEntries: a pack holds the objects that compress as LZ4 blocks and
// the others as they are; a pull keeps the blocks compressed in its journal (it
// syncs less than the objects' size) and stores every object whole. A compressed
// entry whose block is damaged is refused and counted, never stored; the object is
// fetched on its own.
func TestPackCompressedEntries(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	root := compressibleTree(t, a)
	r := openRemote(t, srv, 4)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	raw := getRaw(t, srv, r.PackKey(root))
	ents := packEntries(t, raw)
	var victim casstore.Hash
	compressed, plain := 0, 0
	var total uint64
	for h, e := range ents {
		total += e[0]
		switch {
		case e[1] < e[0]:
			compressed++
			if e[0] == 200*uint64(len("func f7() { return 7 }\n")) {
				victim = h
			}
		default:
			plain++
		}
	}
	if compressed < 40 || plain < 10 || victim.IsZero() {
		t.Fatalf("pack: %d entries compressed, %d not; want the 40 source files compressed, the 10 random ones not", compressed, plain)
	}

	b := newStore(t)
	pr, err := openRemote(t, srv, 4).Pull(ctx, b, root)
	if err != nil || pr.Packs != 1 || pr.Requests != 1 {
		t.Fatalf("pull: %+v, %v; want one pack, one request", pr, err)
	}
	js, err := b.Journals()
	if err != nil || len(js) != 1 || uint64(js[0].Size) >= total {
		t.Fatalf("journals right after the pull: %+v, %v; want the pull's, smaller than the %d bytes of its objects", js, err, total)
	}
	checkComplete(t, b, root)
	b.Settle()
	checkComplete(t, b, root)

	// Damage the victim's block: it must not decode to its bytes.
	rewritePack(t, srv, r, root, func(p []byte) []byte {
		rest := p[88:]
		off := 88
		for {
			var h casstore.Hash
			copy(h[:], rest[:32])
			stored := int(binary.BigEndian.Uint64(rest[40:]))
			if h == victim {
				for i := off + 48 + stored/2; i < off+48+stored; i++ {
					p[i] ^= 0x5a
				}
				return p
			}
			rest = rest[48+stored:]
			off += 48 + stored
		}
	})
	c := newStore(t)
	rr := openRemote(t, srv, 4)
	pr, err = rr.Pull(ctx, c, root)
	if err != nil || pr.Packs != 1 || pr.Requests != 2 {
		t.Fatalf("pull over a damaged compressed entry: %s, %v; want the pack read to its end and one GET for the refused object", srvMetrics(pr), err)
	}
	if m := rr.Metrics().Snapshot(); m.VerifyFailures != 1 || m.PackFailures != 0 {
		t.Fatalf("metrics %+v: want 1 verify failure, no pack failure", m)
	}
	checkComplete(t, c, root)
}

// TestPackVersion1: a pack an earlier version wrote (format version 1: no stored
// length, every entry as it is) is still read: the pull takes the whole root from it.
func TestPackVersion1(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	root := compressibleTree(t, a)
	r := openRemote(t, srv, 4)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	rewritePack(t, srv, r, root, func(p []byte) []byte {
		_, objs := parsePack(t, p)
		v1 := append([]byte(nil), p[:88]...)
		binary.BigEndian.PutUint32(v1[8:], 1)
		rest := p[88:]
		for len(rest) > 0 { // in the pack's order
			var h casstore.Hash
			copy(h[:], rest[:32])
			v1 = append(v1, h[:]...)
			v1 = binary.BigEndian.AppendUint64(v1, uint64(len(objs[h])))
			v1 = append(v1, objs[h]...)
			rest = rest[48+binary.BigEndian.Uint64(rest[40:]):]
		}
		return v1
	})
	b := newStore(t)
	rr := openRemote(t, srv, 4)
	pr, err := rr.Pull(ctx, b, root)
	if err != nil || pr.Packs != 1 || pr.Requests != 1 {
		t.Fatalf("pull of a version 1 pack: %s, %v; want the root from the pack with one request", srvMetrics(pr), err)
	}
	if m := rr.Metrics().Snapshot(); m.VerifyFailures != 0 || m.PackFailures != 0 {
		t.Fatalf("metrics %+v: want no failure", m)
	}
	checkComplete(t, b, root)
}

func srvMetrics(pr remote.PullResult) string {
	return fmt.Sprintf("%d objects, %d present, %d requests, %d packs", pr.Objects, pr.Present, pr.Requests, pr.Packs)
}

// TestPackTruncatedOrGarbage: a pack cut short, or one that is not a pack at all,
// makes the pull fetch the rest object by object, with a metric; it never fails.
func TestPackTruncatedOrGarbage(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	_, root := bigTree(t, a, 200, 300)
	r := openRemote(t, srv, 8)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	n := len(reachable(t, a, root))
	orig := getRaw(t, srv, r.PackKey(root))
	for _, tc := range []struct {
		name string
		pack []byte
	}{
		{"truncated", orig[:len(orig)/2]},
		{"cut in a header", orig[:60]},
		{"garbage", []byte(strings.Repeat("not a pack ", 100))},
		{"count too big", func() []byte {
			b := append([]byte(nil), orig...)
			binary.BigEndian.PutUint64(b[80:], 1<<40)
			return b
		}()},
		{"length overruns", func() []byte {
			b := append([]byte(nil), orig...)
			binary.BigEndian.PutUint64(b[88+32:], 1<<40)
			binary.BigEndian.PutUint64(b[88+40:], 1<<40)
			return b
		}()},
		{"compressed entry too big", func() []byte {
			b := append([]byte(nil), orig...)
			binary.BigEndian.PutUint64(b[88+32:], 1<<40)
			return b
		}()},
		{"stored longer than the object", func() []byte {
			b := append([]byte(nil), orig...)
			binary.BigEndian.PutUint64(b[88+32:], 1)
			return b
		}()},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "-"), func(t *testing.T) {
			putRaw(t, srv, r.PackKey(root), tc.pack)
			b := newStore(t)
			rr := openRemote(t, srv, 8)
			pr, err := rr.Pull(ctx, b, root)
			if err != nil {
				t.Fatalf("pull over a bad pack failed: %v", err)
			}
			if m := rr.Metrics().Snapshot(); m.PackFailures != 1 || m.VerifyFailures != 0 || pr.Packs != 0 {
				t.Fatalf("metrics %+v, pull %s: want one pack failure", m, srvMetrics(pr))
			}
			if pr.Objects != int64(n) {
				t.Fatalf("pulled %d objects, want %d", pr.Objects, n)
			}
			checkComplete(t, b, root)
		})
	}
}

// TestPullWithoutPacks: a bucket written in LunarFS's layout alone (no packs, as a
// LunarFS server or a NoPacks push leaves it) pulls object by object.
func TestPullWithoutPacks(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	_, root := sample(t, a)
	if _, err := openRemoteNoPacks(t, srv, 4).Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	r := openRemote(t, srv, 4)
	if hasKey(t, srv, r.PackKey(root)) {
		t.Fatal("a NoPacks push wrote a pack")
	}
	b := newStore(t)
	pr, err := r.Pull(ctx, b, root)
	if err != nil {
		t.Fatal(err)
	}
	want := len(reachable(t, a, root)) - 1 // H("") is made locally
	// One GET for the missing pack, then one per object.
	if pr.Packs != 0 || pr.Objects != int64(want) || pr.Requests != int64(want)+1 {
		t.Fatalf("pull: %s; want %d objects with %d requests", srvMetrics(pr), want, want+1)
	}
	if m := r.Metrics().Snapshot(); m.PackFailures != 0 {
		t.Fatalf("a missing pack counted as a failure: %+v", m)
	}
	checkComplete(t, b, root)
}

// TestPackPullInterrupted: MinIO killed while a pull streams a pack: a clear error,
// only whole objects in the store, and a re-run completes fetching only the rest.
func TestPackPullInterrupted(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	// 48 MB that do not compress, more than the socket buffers hold, so the kill
	// lands mid-stream.
	dir := t.TempDir()
	files := map[string]string{}
	for i := 0; i < 400; i++ {
		b := make([]byte, 120<<10)
		rand.Read(b)
		files[fmt.Sprintf("d%02d/f%04d", i%20, i)] = string(b)
	}
	writeFiles(t, dir, files)
	root := ingestDir(t, a, dir)
	if _, err := openRemote(t, srv, 16).Push(ctx, a, root, remote.PushOptions{}); err != nil {
		t.Fatal(err)
	}
	b := newStore(t)
	pullKilledMidway(ctx, t, srv, openRemote(t, srv, 4), b, root, 40)
	srv.Restart(t)
	pr, err := openRemote(t, srv, 8).Pull(ctx, b, root)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Present == 0 || pr.Packs != 1 {
		t.Fatalf("re-run: %s; want the pack read again and what the first run stored kept", srvMetrics(pr))
	}
	t.Logf("re-run: %s", srvMetrics(pr))
	checkComplete(t, b, root)
}

// TestPackBigTree: a tree larger than the entries a pull reads into its slabs (over
// 4 MiB: 100k entries) comes from the pack whole and is walked, so what it names is
// pulled too.
func TestPackBigTree(t *testing.T) {
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	blob, err := a.PutBytes([]byte("named a hundred thousand times\n"))
	if err != nil {
		t.Fatal(err)
	}
	ents := make([]casstore.Entry, 100_000)
	for i := range ents {
		ents[i] = casstore.Entry{Mode: casstore.ModeFile, Name: fmt.Sprintf("f%06d", i), Hash: blob}
	}
	raw, err := casstore.EncodeTree(ents)
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) <= 4<<20 {
		t.Fatalf("tree of %d bytes: not bigger than a pull's in-memory entries", len(raw))
	}
	big, err := a.PutBytes(raw)
	if err != nil {
		t.Fatal(err)
	}
	rootRaw, err := casstore.EncodeTree([]casstore.Entry{{Mode: casstore.ModeDir, Name: "big", Hash: big}})
	if err != nil {
		t.Fatal(err)
	}
	root, err := a.PutBytes(rootRaw)
	if err != nil {
		t.Fatal(err)
	}
	r := openRemote(t, srv, 4)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	b := newStore(t)
	pr, err := openRemote(t, srv, 4).Pull(ctx, b, root)
	if err != nil || pr.Packs != 1 || pr.Requests != 1 || pr.Objects != 3 {
		t.Fatalf("pull: %s, %v; want the 3 objects from the pack with one request", srvMetrics(pr), err)
	}
	checkComplete(t, b, root)
}

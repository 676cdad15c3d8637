package remote_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/fuse"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// TestLazyViewOverBucket serves a root that only the bucket holds through a FUSE
// view with the remote as its BlobSource: a file is fetched on first read and
// verified; with the bucket down another file gets EIO (the view keeps serving what
// is local), and once the bucket is back it reads; a corrupted object is refused
// with EIO, counted, and never stored.
func TestLazyViewOverBucket(t *testing.T) {
	testenv.RequireRoot(t)
	if testing.Short() {
		t.Skip("mounts a FUSE view: skipped with -short")
	}
	srv := s3test.Start(t)
	ctx := ctxT(t)
	a := newStore(t)
	dir, root := sample(t, a)
	r := openRemote(t, srv, 4)
	if _, err := r.Push(ctx, a, root, remote.PushOptions{Ref: "main"}); err != nil {
		t.Fatal(err)
	}
	b := newStore(t)
	if err := r.FetchInto(ctx, b, root); err != nil {
		t.Fatal(err)
	}
	mnt := t.TempDir()
	v, err := fuse.Mount(context.Background(), b, root, mnt, fuse.Options{Source: r})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Unmount() })
	read := func(p string) ([]byte, error) { return os.ReadFile(filepath.Join(mnt, p)) }
	want := func(p string) []byte {
		w, err := os.ReadFile(filepath.Join(dir, p))
		if err != nil {
			t.Fatal(err)
		}
		return w
	}

	if got, err := read("README.md"); err != nil || !bytes.Equal(got, want("README.md")) {
		t.Fatalf("README.md through the view: %q, %v", got, err)
	}
	if ok, _ := b.Has(casstore.Sum(want("README.md"))); !ok {
		t.Fatal("README.md was served but not stored")
	}
	if ok, _ := b.Has(casstore.Sum(want("a/b/c.txt"))); ok {
		t.Fatal("a/b/c.txt was fetched before anyone read it")
	}
	// Make a/b's tree local, so the outage hits only the file's bytes.
	if _, err := os.Stat(filepath.Join(mnt, "a/b/c.txt")); err != nil {
		t.Fatal(err)
	}

	srv.Kill()
	if _, err := read("a/b/c.txt"); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read with the bucket down: %v, want EIO", err)
	}
	if got, err := read("README.md"); err != nil || !bytes.Equal(got, want("README.md")) {
		t.Fatalf("a hydrated file with the bucket down: %q, %v", got, err)
	}
	srv.Restart(t)
	if got, err := read("a/b/c.txt"); err != nil || !bytes.Equal(got, want("a/b/c.txt")) {
		t.Fatalf("a/b/c.txt once the bucket is back: %q, %v", got, err)
	}

	// A corrupted object in the bucket: EIO, counted, not stored.
	victim := casstore.Sum(want("run.sh"))
	evil := []byte("#!/bin/sh\nrm -rf /\n")
	putRaw(t, srv, r.BlobKey(victim), evil)
	before := r.Metrics().Snapshot().VerifyFailures
	if _, err := read("run.sh"); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a corrupted object: %v, want EIO", err)
	}
	if got := r.Metrics().Snapshot().VerifyFailures - before; got < 1 {
		t.Fatalf("verify failures counted: %d", got)
	}
	for _, h := range []casstore.Hash{victim, casstore.Sum(evil)} {
		if ok, _ := b.Has(h); ok {
			t.Fatalf("object %s was stored", h)
		}
	}
}

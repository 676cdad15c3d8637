package kview

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Prober says whether kernel views work on this host for a root directory: nil, or
// an error naming what is missing. The daemon's doctor checks use the same probe.
type Prober func(root string) error

// Probe is the real probe: it builds a one-file image in a temp directory under root,
// mounts it as a kernel view over a one-object store there, reads the file back
// through the view and unmounts it. Every requirement (EROFS mounting files,
// overlayfs data-only layers and metacopy redirects, the privilege to mount, trusted
// xattrs) is exercised the way views use it, so a nil answer means views work.
func Probe(root string) (retErr error) {
	if err := ensureDir(root); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(root, ".kview-probe-")
	if err != nil {
		return fmt.Errorf("kernel views: %w", err)
	}
	defer os.RemoveAll(tmp)
	fail := func(err error) error { return fmt.Errorf("kernel views unsupported under %s: %w", root, err) }
	store, err := casstore.Open(filepath.Join(tmp, "cas"))
	if err != nil {
		return fail(err)
	}
	want := "tidepool kernel view probe\n"
	obj, err := store.PutBytes([]byte(want))
	if err != nil {
		return fail(err)
	}
	tree, err := store.WriteTree([]casstore.Entry{{Mode: casstore.ModeFile, Name: "probe", Hash: obj}})
	if err != nil {
		return fail(err)
	}
	spec := Spec{Root: tree}
	t, err := Scan(context.Background(), store, spec)
	if err != nil {
		return fail(err)
	}
	img, err := os.Create(filepath.Join(tmp, "probe.erofs"))
	if err != nil {
		return fail(err)
	}
	err = t.WriteImage(img)
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fail(err)
	}
	mnt := filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return fail(err)
	}
	if err := mountView(img.Name(), store.Root(), "probe", mnt); err != nil {
		return fail(err)
	}
	defer func() {
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil && retErr == nil {
			retErr = fail(fmt.Errorf("unmount probe view: %w", err))
		}
	}()
	got, err := os.ReadFile(filepath.Join(mnt, "probe"))
	if err != nil {
		return fail(fmt.Errorf("read through the view (overlayfs metacopy redirect into a data-only layer): %w", err))
	}
	if string(got) != want {
		return fail(fmt.Errorf("read through the view gave %q, want %q", got, want))
	}
	return nil
}

package ingest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
	"github.com/tidepool-dev/tidepool/kview"
)

// namePool is small so that random edits keep hitting existing names; it holds a
// name that is already the lossy form of the non-UTF-8 names, so collisions happen.
var namePool = []string{"a", "b", "c", "lib", "src", "main.go", "x.txt", ".gitignore", "é", "n\uFFFDx", "node_modules"}

var rawPool = []string{"n\xffx", "n\xfex"}

func pickName(r *rand.Rand) string {
	switch k := r.IntN(40); {
	case k == 0:
		return rawPool[r.IntN(len(rawPool))]
	case k == 1:
		return ".git"
	case k < 8:
		return fmt.Sprintf("f%d", r.IntN(30))
	default:
		return namePool[r.IntN(len(namePool))]
	}
}

func randContent(r *rand.Rand) []byte {
	if r.IntN(5) == 0 {
		return nil
	}
	b := make([]byte, r.IntN(300))
	for i := range b {
		b[i] = byte('a' + r.IntN(4)) // few distinct contents: shared blobs
	}
	return b
}

func randPerm(r *rand.Rand) os.FileMode {
	return []os.FileMode{0o644, 0o600, 0o755, 0o700, 0o610, 0o601}[r.IntN(6)]
}

// genTree writes a random source tree: files, empty dirs, symlinks, FIFOs, .git.
func genTree(t testing.TB, r *rand.Rand, dir string, depth int) {
	mkdirs(t, dir)
	for range r.IntN(7) {
		p := filepath.Join(dir, pickName(r))
		if _, err := os.Lstat(p); err == nil {
			continue
		}
		switch k := r.IntN(12); {
		case k < 6:
			if err := os.WriteFile(p, randContent(r), randPerm(r)); err != nil {
				t.Fatal(err)
			}
			_ = os.Chmod(p, randPerm(r))
		case k < 9 && depth < 4:
			genTree(t, r, p, depth+1)
		case k == 9:
			_ = os.Symlink(pickName(r), p)
		case k == 10:
			_ = unix.Mkfifo(p, 0o644)
		default:
			mkdirs(t, p)
		}
	}
}

// entries lists what lies under root in the merged view (root itself included).
func entries(root string) (dirs, files, all []string) {
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		all = append(all, p)
		switch {
		case d.IsDir():
			dirs = append(dirs, p)
		case d.Type().IsRegular():
			files = append(files, p)
		}
		return nil
	})
	return dirs, files, all
}

func pick(r *rand.Rand, xs []string) (string, bool) {
	if len(xs) == 0 {
		return "", false
	}
	return xs[r.IntN(len(xs))], true
}

// writeNB writes a file like os.WriteFile, but never blocks on a FIFO that happens to
// sit at path (O_NONBLOCK makes the open fail instead).
func writeNB(path string, data []byte, perm os.FileMode) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NONBLOCK, perm)
	if err != nil {
		return
	}
	f.Write(data)
	f.Close()
}

// randomEdit applies one random change through the merged mount. Errors are ignored on
// purpose: an edit the filesystem refuses (EXDEV for a lower dir rename, EISDIR, ...)
// simply does not happen, as for a user.
func randomEdit(r *rand.Rand, merged, prefix string) string {
	root := filepath.Join(merged, prefix)
	dirs, files, all := entries(root)
	inner := all
	if len(inner) > 0 && inner[0] == root {
		inner = inner[1:]
	}
	dir, ok := pick(r, dirs)
	if !ok {
		dir = root
	}
	newPath := filepath.Join(dir, pickName(r))
	switch k := r.IntN(30); k {
	case 0, 1, 2: // create or overwrite a file
		writeNB(newPath, randContent(r), randPerm(r))
		return "write " + newPath
	case 3, 4: // modify a file in place
		if f, ok := pick(r, files); ok {
			fh, err := os.OpenFile(f, os.O_WRONLY|os.O_APPEND|unix.O_NONBLOCK, 0)
			if err == nil {
				fh.Write(randContent(r))
				fh.Close()
			}
			return "append " + f
		}
	case 5: // truncate to zero (an empty upper file is not a whiteout)
		if f, ok := pick(r, files); ok {
			_ = os.Truncate(f, 0)
			return "truncate " + f
		}
	case 6, 7: // delete a file
		if f, ok := pick(r, files); ok {
			_ = os.Remove(f)
			return "rm " + f
		}
	case 8, 9: // chmod +x / -x
		if f, ok := pick(r, files); ok {
			_ = os.Chmod(f, randPerm(r))
			return "chmod " + f
		}
	case 10: // mkdir
		_ = os.Mkdir(newPath, 0o755)
		return "mkdir " + newPath
	case 11: // rm -rf a dir
		if d, ok := pick(r, dirs[min(1, len(dirs)):]); ok {
			_ = os.RemoveAll(d)
			return "rm -rf " + d
		}
	case 12: // rm -rf then mkdir again: an opaque dir
		if d, ok := pick(r, dirs[min(1, len(dirs)):]); ok {
			_ = os.RemoveAll(d)
			_ = os.Mkdir(d, 0o755)
			if r.IntN(2) == 0 {
				writeNB(filepath.Join(d, pickName(r)), randContent(r), randPerm(r))
			}
			return "recreate " + d
		}
	case 13: // file -> dir
		if f, ok := pick(r, files); ok {
			_ = os.Remove(f)
			_ = os.Mkdir(f, 0o755)
			writeNB(filepath.Join(f, pickName(r)), randContent(r), randPerm(r))
			return "file->dir " + f
		}
	case 14: // dir -> file
		if d, ok := pick(r, dirs[min(1, len(dirs)):]); ok {
			_ = os.RemoveAll(d)
			writeNB(d, randContent(r), randPerm(r))
			return "dir->file " + d
		}
	case 15: // symlink, possibly over a deleted entry
		if r.IntN(2) == 0 {
			if e, ok := pick(r, inner); ok {
				_ = os.RemoveAll(e)
				newPath = e
			}
		}
		_ = os.Symlink([]string{"a", "../x", "/etc/hosts", "n\xffx", "."}[r.IntN(5)], newPath)
		return "symlink " + newPath
	case 16: // FIFO, possibly over a deleted entry
		if r.IntN(2) == 0 {
			if e, ok := pick(r, inner); ok {
				_ = os.RemoveAll(e)
				newPath = e
			}
		}
		_ = unix.Mkfifo(newPath, 0o644)
		return "mkfifo " + newPath
	case 17: // rename a file (copy-up, whiteout at the source)
		if f, ok := pick(r, files); ok {
			_ = os.Rename(f, newPath)
			return "mv " + f + " " + newPath
		}
	case 18, 26, 27, 28, 29: // rename a dir (EXDEV for lower dirs unless redirect_dir is on)
		if r.IntN(2) == 0 {
			newPath = filepath.Join(dir, fmt.Sprintf("r%d", r.IntN(4))) // often free
		}
		if d, ok := pick(r, dirs[min(1, len(dirs)):]); ok && !strings.HasPrefix(newPath, d+"/") {
			_ = os.Rename(d, newPath)
			return "mv " + d + " " + newPath
		}
	case 19: // touch: copy-up without a change
		if f, ok := pick(r, files); ok {
			now := time.Now()
			_ = os.Chtimes(f, now, now)
			return "touch " + f
		}
	case 20: // hard link
		if f, ok := pick(r, files); ok {
			_ = os.Link(f, newPath)
			return "ln " + f + " " + newPath
		}
	case 21: // a device node
		_ = unix.Mknod(newPath, unix.S_IFCHR|0o644, int(unix.Mkdev(1, 3)))
		return "mknod " + newPath
	case 22: // edits outside the prefix: image changes, not source
		if prefix != "" {
			writeNB(filepath.Join(merged, "etc", pickName(r)), randContent(r), 0o644)
			_ = os.RemoveAll(filepath.Join(merged, "etc", "hosts"))
			return "edit outside the prefix"
		}
	case 24: // an image file moved into the tree (with metacopy: its data stays in the image)
		if prefix != "" {
			from := filepath.Join(merged, []string{"etc/hosts", "usr/bin/tool"}[r.IntN(2)])
			_ = os.Rename(from, newPath)
			return "mv " + from + " " + newPath
		}
	case 25: // chmod of an image file under the tree... none exist; chmod a dir instead
		if d, ok := pick(r, dirs); ok {
			_ = os.Chmod(d, 0o700)
			return "chmod " + d
		}
	case 23: // rarely: the whole prefix removed, maybe recreated (opaque)
		if prefix != "" && r.IntN(4) == 0 {
			_ = os.RemoveAll(root)
			if r.IntN(2) == 0 {
				_ = os.Mkdir(root, 0o755)
				writeNB(filepath.Join(root, pickName(r)), randContent(r), randPerm(r))
			}
			return "rm -rf the prefix"
		}
	}
	return "no-op"
}

// hasRedirect reports whether a directory under dir (outside .git, which ingest never
// reads) carries an overlay redirect xattr: a renamed directory.
func hasRedirect(dir string) bool {
	return anyUpper(dir, func(d fs.DirEntry, a ovlAttrs) bool { return d.IsDir() && a.redirect })
}

// hasMetacopy reports whether a file under dir is a metadata-only copy-up.
func hasMetacopy(dir string) bool {
	return anyUpper(dir, func(d fs.DirEntry, a ovlAttrs) bool { return d.Type().IsRegular() && a.metacopy })
}

// anyUpper reports whether an entry under dir (outside .git) and its overlay xattrs
// match.
func anyUpper(dir string, match func(fs.DirEntry, ovlAttrs) bool) bool {
	found := false
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		switch {
		case err != nil || found:
			return nil
		case d.Name() == ".git" && d.IsDir():
			return filepath.SkipDir
		}
		if a, err := overlayAttrs(p); err == nil && match(d, a) {
			found = true
		}
		return nil
	})
	return found
}

// TestUpperEqualsMergedIngest is the property Upper exists for: after random edits
// through a real kernel overlay, committing the upper dir over the base gives the same
// root as ingesting the overlay's merged view. Reproduce a failure with
// TIDEPOOL_SEED=<seed printed in the subtest name>.
func TestUpperEqualsMergedIngest(t *testing.T) {
	requireRoot(t)
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("TIDEPOOL_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("TIDEPOOL_SEED: %v", err)
		}
	}
	iterations := 120
	if testing.Short() {
		iterations = 15
	}
	if os.Getenv("TIDEPOOL_SEED") != "" {
		iterations = 1
	}
	s := casstoretest.NewStore(t)
	outcomes := map[string]int{}
	for i := range iterations {
		iterSeed := seed + uint64(i)
		t.Run(fmt.Sprintf("seed=%d", iterSeed), func(t *testing.T) { outcomes[overlayIteration(t, s, iterSeed)]++ })
		if t.Failed() {
			t.Logf("reproduce with TIDEPOOL_SEED=%d go test -run TestUpperEqualsMergedIngest ./casstore/ingest", iterSeed)
			return
		}
	}
	t.Logf("outcomes over %d iterations: %v", iterations, outcomes)
	changed, redirected := 0, 0
	for k, n := range outcomes {
		if strings.HasPrefix(k, "changed") {
			changed += n
		}
		if strings.Contains(k, "redirected dirs") {
			redirected += n
		}
	}
	if iterations >= 15 && changed == 0 {
		t.Fatal("no iteration produced a root different from its base: the edits are not reaching the upper")
	}
	if iterations >= 120 && redirected == 0 && kernelViews(t) {
		t.Fatal("no iteration renamed a directory under redirect_dir: the property does not cover redirects")
	}
}

// overlayIteration runs one random case and says how it ended: "changed" or
// "unchanged" (Upper == Dir(merged)), "collision" (both refused), "redirect" (Upper
// refused a redirect the upper really holds), "bad source" (nothing to test).
func overlayIteration(t *testing.T, s *casstore.Store, seed uint64) string {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	opts := Options{LunarStrict: r.IntN(3) == 0}
	prefix := []string{"", "app", "srv/api"}[r.IntN(3)]
	// How the base is layered: from a checkout, plain or with metacopy and
	// redirect_dir (be correct when someone enables them), or, where the kernel can,
	// as the snapshotter layers a kernel view: nested (the view's own overlay as a
	// plain lower layer) or direct (the EROFS image itself as lower layer, the object
	// directory as data-only layer, metacopy=on,redirect_dir=on: chmod leaves
	// metadata-only copy-ups and directory renames leave redirect xattrs).
	layering := "checkout"
	switch k := r.IntN(8); {
	case k < 2:
		layering = "checkout, metacopy=on,redirect_dir=on"
	case k < 4:
		layering = "kernel view, nested"
	case k < 7:
		layering = "kernel view, direct"
	}
	if strings.HasPrefix(layering, "kernel view") && !kernelViews(t) {
		layering = "checkout"
	}
	tmp := t.TempDir()

	src := filepath.Join(tmp, "src")
	genTree(t, r, src, 0)
	base, _, err := Dir(t.Context(), s, src, opts)
	if errors.Is(err, ErrNameCollision) {
		return "bad source" // the random source itself has colliding names
	}
	if err != nil {
		t.Fatal(err)
	}

	image := filepath.Join(tmp, "image") // the image's own layer: nothing under the prefix
	mkdirs(t, image)
	if prefix != "" {
		writeFile(t, filepath.Join(image, "etc", "hosts"), "127.0.0.1 localhost\n", 0o644)
		writeFile(t, filepath.Join(image, "usr", "bin", "tool"), "#!/bin/sh\n", 0o755)
		if prefix == "srv/api" {
			writeFile(t, filepath.Join(image, "srv", "other", "conf"), "x=1\n", 0o644)
		}
	}
	opts.Lowers = []string{image}
	lower := filepath.Join(tmp, "lower") // the fork: the base tree placed at the prefix
	lowers := []string{lower, image}
	overlayOpts := ""
	switch layering {
	case "kernel view, nested":
		mkdirs(t, lower)
		mountKernelView(t, s, base, prefix, lower, false)
	case "kernel view, direct":
		mkdirs(t, lower)
		data := mountKernelView(t, s, base, prefix, lower, true)
		lowers[len(lowers)-1] += "::" + data
		overlayOpts = "metacopy=on,redirect_dir=on"
	default:
		mkdirs(t, filepath.Dir(filepath.Join(lower, prefix)))
		checkout(t, s, base, filepath.Join(lower, prefix))
		if layering != "checkout" {
			overlayOpts = "metacopy=on,redirect_dir=on"
		}
	}
	upper, work, merged := filepath.Join(tmp, "upper"), filepath.Join(tmp, "work"), filepath.Join(tmp, "merged")
	mkdirs(t, upper, work, merged)
	if err := mountOverlay(t, merged, lowers, upper, work, overlayOpts); err != nil {
		t.Fatal(err)
	}

	var log []string
	for range 1 + r.IntN(40) {
		log = append(log, randomEdit(r, merged, prefix))
	}
	failf := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("prefix %q, strict=%v, layering %q\nedits:\n  %s\n%s", prefix, opts.LunarStrict, layering,
			strings.Join(log, "\n  "), fmt.Sprintf(format, args...))
	}

	// Expected: ingest the merged view (or nothing, if the prefix is gone).
	var want casstore.Hash
	var wantErr error
	mp := filepath.Join(merged, prefix)
	if st, err := os.Lstat(mp); err != nil || !st.IsDir() {
		want = casstore.EmptyHash
	} else {
		want, _, wantErr = Dir(t.Context(), s, mp, opts)
	}
	got, err := Upper(t.Context(), s, base, upper, prefix, opts)

	switch {
	case wantErr != nil:
		if !errors.Is(wantErr, ErrNameCollision) || !errors.Is(err, ErrNameCollision) {
			failf("Dir(merged) err = %v, Upper err = %v; want both ErrNameCollision", wantErr, err)
		}
		return "collision"
	case err != nil:
		failf("Upper: %v", err)
	case got != want:
		failf("Upper = %s, Dir(merged) = %s\n%s", got, want, diffListings(listing(t, s, want), listing(t, s, got)))
	}
	if got == base {
		return "unchanged"
	}
	what := "changed (" + layering
	if hasRedirect(filepath.Join(upper, prefix)) {
		what += "; redirected dirs"
	}
	if hasMetacopy(filepath.Join(upper, prefix)) {
		what += "; metacopy files"
	}
	return what + ")"
}

var (
	kernelViewsOnce sync.Once
	kernelViewsErr  error
)

// kernelViews reports whether kernel fork views work here (see kview.Probe).
func kernelViews(t testing.TB) bool {
	kernelViewsOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kview-probe-")
		if err != nil {
			kernelViewsErr = err
			return
		}
		defer os.RemoveAll(dir)
		kernelViewsErr = kview.Probe(dir)
	})
	if kernelViewsErr != nil {
		t.Logf("no kernel views: %v", kernelViewsErr)
	}
	return kernelViewsErr == nil
}

// mountKernelView mounts the kernel view of root (at prefix, owned by 0:0) at dir
// until the test ends, or with imageOnly its image alone, and returns the directory
// the image's redirects point into.
func mountKernelView(t testing.TB, s *casstore.Store, root casstore.Hash, prefix, dir string, imageOnly bool) string {
	t.Helper()
	h, err := kview.NewHost(s, filepath.Join(t.TempDir(), "images"))
	if err != nil {
		t.Fatal(err)
	}
	mount := h.Mount
	if imageOnly {
		mount = h.MountImage
	}
	if err := mount(t.Context(), dir, kview.Spec{Root: root, Prefix: prefix}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Unmount(context.Background(), dir); err != nil {
			t.Errorf("unmount kernel view: %v", err)
		}
	})
	return h.DataDir()
}

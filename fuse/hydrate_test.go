package fuse

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// forEachOpenMode runs a test with served opens and in NoOpen mode.
func forEachOpenMode(t *testing.T, test func(t *testing.T, noOpen bool)) {
	requireRoot(t)
	for _, m := range openModes {
		t.Run(m.name, func(t *testing.T) { test(t, m.noOpen) })
	}
}

func TestHydrationFetchesOnceUnderConcurrentOpens(t *testing.T) {
	forEachOpenMode(t, testHydrationFetchesOnce)
}

// testHydrationFetchesOnce: the first open (or, in NoOpen mode, the first read) of
// a file fetches its object once, however many readers wait for it.
func testHydrationFetchesOnce(t *testing.T, noOpen bool) {
	remote := newStore(t)
	root := ingestTree(t, remote, writeFixture(t))
	local := newStore(t)
	src := newFakeSource(remote)
	v := mount(t, local, root, Options{Source: src, NoOpen: noOpen})
	requireOpenMode(t, v, noOpen)
	big := lookupHash(t, remote, root, "big.bin").Hash

	// Sizes come from the source without fetching the blob.
	info, err := os.Stat(filepath.Join(v.Dir(), "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if info.Size() != 1<<20 || info.Sys().(*syscall.Stat_t).Blocks != 2048 {
		t.Errorf("big.bin size %d blocks %d before hydration", info.Size(), info.Sys().(*syscall.Stat_t).Blocks)
	}
	if n := src.fetchCount(big); n != 0 {
		t.Fatalf("stat fetched the blob %d times", n)
	}
	if ok, _ := local.Has(big); ok {
		t.Fatal("blob is local before anyone opened it")
	}
	// The trees on the way were hydrated, and only they.
	if !objects(t, local)[root] {
		t.Error("root tree was not hydrated by the lookup")
	}

	// 50 concurrent opens while the fetch is held open: one fetch for all.
	gate := make(chan struct{})
	src.mu.Lock()
	src.gate = gate
	src.mu.Unlock()
	want, err := remote.ReadAll(big, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	const readers = 50
	var wg sync.WaitGroup
	errs := make(chan error, readers)
	for range readers {
		wg.Go(func() {
			got, err := os.ReadFile(filepath.Join(v.Dir(), "big.bin"))
			if err != nil {
				errs <- err
			} else if !bytes.Equal(got, want) {
				errs <- errors.New("wrong content")
			}
		})
	}
	deadline := time.Now().Add(10 * time.Second)
	for src.fetchCount(big) == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // let the other opens pile up behind the fetch
	close(gate)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("reader: %v", err)
	}
	if n := src.fetchCount(big); n != 1 {
		t.Errorf("blob fetched %d times, want 1", n)
	}
	if ok, _ := local.Has(big); !ok {
		t.Error("hydrated blob was not stored")
	}
	if err := local.Verify(big); err != nil {
		t.Errorf("stored blob: %v", err)
	}
	st := v.Stats()
	if st.HydratedBytes.Load() < 1<<20 || st.Hydrations.Load() == 0 {
		t.Errorf("hydrations %d bytes %d", st.Hydrations.Load(), st.HydratedBytes.Load())
	}

	// From now on it is served locally.
	before := src.totalFetches()
	if got := readString(t, filepath.Join(v.Dir(), "big.bin")); got != string(want) {
		t.Error("re-read differs")
	}
	if src.totalFetches() != before {
		t.Error("a local blob was fetched again")
	}
	// Symlink targets and nested trees hydrate too.
	if got, err := os.Readlink(filepath.Join(v.Dir(), "src/up")); err != nil || got != "../README.md" {
		t.Errorf("readlink through hydration = %q, %v", got, err)
	}
	if got := readString(t, filepath.Join(v.Dir(), "src/util/strings.go")); got != "package util\n" {
		t.Errorf("nested file = %q", got)
	}
}

func TestHydrationRejectsWrongBytes(t *testing.T) {
	forEachOpenMode(t, testHydrationRejectsWrongBytes)
}

func testHydrationRejectsWrongBytes(t *testing.T, noOpen bool) {
	remote := newStore(t)
	root := ingestTree(t, remote, writeFixture(t))
	local := newStore(t)
	src := newFakeSource(remote)
	v := mount(t, local, root, Options{Source: src, NoOpen: noOpen})
	requireOpenMode(t, v, noOpen)
	readme := lookupHash(t, remote, root, "README.md").Hash

	if got := listNames(t, v.Dir()); len(got) == 0 { // trees hydrate honestly
		t.Fatal("empty root")
	}
	objs, files := objects(t, local), storeFiles(t, local)
	src.mu.Lock()
	src.lie = true
	src.mu.Unlock()
	if _, err := os.ReadFile(filepath.Join(v.Dir(), "README.md")); !isErrno(err, syscall.EIO) {
		t.Fatalf("read of a blob the source tampered with: %v, want EIO", err)
	}
	if got := objects(t, local); len(got) != len(objs) || got[readme] {
		t.Errorf("store changed after a failed hydration: %d objects, was %d", len(got), len(objs))
	}
	if got := storeFiles(t, local); got != files {
		t.Errorf("store holds %d files after a failed hydration, was %d (temp files left?)", got, files)
	}
	if v.Stats().Errors(ErrHydrate) == 0 {
		t.Error("failed hydration not counted")
	}
	// The failure is not remembered: an honest source later fixes it, with one more
	// fetch. (The kernel may retry a failed read, so the lies may be more than one.)
	lies := src.fetchCount(readme)
	if lies == 0 {
		t.Fatal("README was never fetched")
	}
	src.mu.Lock()
	src.lie = false
	src.mu.Unlock()
	if got := readString(t, filepath.Join(v.Dir(), "README.md")); got != "# fixture\n" {
		t.Errorf("after the source recovered: %q", got)
	}
	if n := src.fetchCount(readme); n != lies+1 {
		t.Errorf("README fetched %d times after %d failed fetches, want one more", n, lies)
	}
}

func TestHydrationMissingAtSource(t *testing.T) {
	forEachOpenMode(t, testHydrationMissingAtSource)
}

func testHydrationMissingAtSource(t *testing.T, noOpen bool) {
	remote := newStore(t)
	root := ingestTree(t, remote, writeFixture(t))
	local := newStore(t)
	v := mount(t, local, root, Options{Source: newFakeSource(remote), NoOpen: noOpen})
	requireOpenMode(t, v, noOpen)
	if err := os.Remove(remote.Path(lookupHash(t, remote, root, "src/main.go").Hash)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join(v.Dir(), "src/main.go")); !isErrno(err, syscall.EIO) {
		t.Errorf("read of a blob missing everywhere: %v, want EIO", err)
	}
	if got := readString(t, filepath.Join(v.Dir(), "README.md")); got != "# fixture\n" {
		t.Errorf("README = %q", got)
	}
	if v.Stats().Errors(ErrHydrate) == 0 {
		t.Error("object missing at the source not counted")
	}
	// A root missing at the source is refused at mount.
	_, err := Mount(t.Context(), local, casstore.Sum([]byte("nowhere")), t.TempDir(), Options{Source: newFakeSource(remote), NoOpen: noOpen})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("mount of a root missing at the source: %v", err)
	}
}

// TestManyReadersManyViews runs 200 concurrent readers over 21 views of one root, a
// third of them without passthrough and a third in NoOpen mode, so both of the
// server's read paths run under the race detector too.
func TestManyReadersManyViews(t *testing.T) {
	requireRoot(t)
	s, root := goStore(t)
	var files []string
	for _, dir := range []string{"strings", "bytes", "sort", "unicode/utf8", "container/list", "errors"} {
		ents, err := os.ReadDir(filepath.Join(goSrc, dir))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if e.Type().IsRegular() {
				files = append(files, dir+"/"+e.Name())
			}
		}
	}
	want := map[string][]byte{}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(goSrc, f))
		if err != nil {
			t.Fatal(err)
		}
		want[f] = b
	}
	stats := &Stats{}
	views := make([]*View, 21)
	for i := range views {
		views[i] = mount(t, s, root, Options{Stats: stats, DisablePassthrough: i%3 == 1, NoOpen: i%3 == 2})
	}
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for r := range 200 {
		wg.Go(func() {
			v := views[r%len(views)]
			rng := rand.New(rand.NewPCG(uint64(r), 7))
			for range 15 {
				f := files[rng.IntN(len(files))]
				got, err := os.ReadFile(filepath.Join(v.Dir(), f))
				if err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(got, want[f]) {
					errs <- fmt.Errorf("%s via %s: wrong content", f, v.Dir())
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if stats.Opens.Load() == 0 || stats.Reads.Load() == 0 {
		t.Errorf("shared stats: %d opens, %d reads", stats.Opens.Load(), stats.Reads.Load())
	}
	if views[0].PassthroughActive() && stats.PassthroughOpens.Load() == 0 {
		t.Error("no passthrough opens counted")
	}
	if n := stats.Errors(ErrIO) + stats.Errors(ErrCorrupt) + stats.Errors(ErrMissing); n != 0 {
		t.Errorf("%d errors", n)
	}
}

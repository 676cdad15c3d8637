package ingest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

func blob(s string) casstore.Hash { return casstore.Sum([]byte(s)) }

// TestDirRules checks the walk rules on a nested tree against a root spelled out entry
// by entry: .git skipped at any depth as dir or file, empty directories kept at any
// depth, exec if any x bit, specials skipped, symlinks to directories not followed.
func TestDirRules(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "run"), "#!/bin/sh\n", 0o700)
	writeFile(t, filepath.Join(dir, "other-x"), "#!/bin/sh\n", 0o641)
	writeFile(t, filepath.Join(dir, "plain"), "text", 0o600)
	writeFile(t, filepath.Join(dir, ".git", "HEAD"), "ref", 0o644)
	writeFile(t, filepath.Join(dir, "deep", "sub", ".git"), "gitdir: x", 0o644)
	writeFile(t, filepath.Join(dir, "deep", "sub", ".gitignore"), "*.o\n", 0o644)
	writeFile(t, filepath.Join(dir, "deep", ".git", "objects", "ab"), "obj", 0o644)
	mkdirs(t, filepath.Join(dir, "deep", "empty", "emptier"))
	symlink(t, "deep", filepath.Join(dir, "dirlink"))
	symlink(t, "/nonexistent/\xff", filepath.Join(dir, "dangling"))
	mkfifo(t, filepath.Join(dir, "deep", "fifo"))
	l, err := listenUnix(filepath.Join(dir, "deep", "sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l()

	s := casstoretest.NewStore(t)
	emptier := casstoretest.Tree(t, s)
	empty := casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeDir, Name: "emptier", Hash: emptier})
	sub := casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: ".gitignore", Hash: blob("*.o\n")})
	deep := casstoretest.Tree(t, s,
		casstore.Entry{Mode: casstore.ModeDir, Name: "empty", Hash: empty},
		casstore.Entry{Mode: casstore.ModeDir, Name: "sub", Hash: sub})
	common := []casstore.Entry{
		{Mode: casstore.ModeDir, Name: "deep", Hash: deep},
		{Mode: casstore.ModeExec, Name: "other-x", Hash: blob("#!/bin/sh\n")},
		{Mode: casstore.ModeFile, Name: "plain", Hash: blob("text")},
		{Mode: casstore.ModeExec, Name: "run", Hash: blob("#!/bin/sh\n")},
	}
	wantStrict := casstoretest.Tree(t, s, common...)
	wantDefault := casstoretest.Tree(t, s, append(slices.Clone(common),
		casstore.Entry{Mode: casstore.ModeSymlink, Name: "dirlink", Hash: blob("deep")},
		casstore.Entry{Mode: casstore.ModeSymlink, Name: "dangling", Hash: blob("/nonexistent/\xff")})...)

	got, st, err := Dir(t.Context(), s, dir, Options{LunarStrict: true})
	if err != nil {
		t.Fatal(err)
	}
	if got != wantStrict {
		t.Fatalf("strict root %s, want %s\n%s", got, wantStrict, strings.Join(listing(t, s, got), "\n"))
	}
	// 4 files; dirs: root, deep, sub, empty, emptier; skipped: 2 .git, 1 .git file,
	// fifo, socket, 2 symlinks; of those, fifo and socket are special files.
	want := Stats{Files: 4, Dirs: 5, Skipped: 7, Special: 2, Bytes: int64(2*len("#!/bin/sh\n") + len("text") + len("*.o\n"))}
	if st != want {
		t.Errorf("strict stats %+v, want %+v", st, want)
	}
	got, st, err = Dir(t.Context(), s, dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got != wantDefault {
		t.Fatalf("default root %s, want %s\n%s", got, wantDefault, strings.Join(listing(t, s, got), "\n"))
	}
	want.Symlinks, want.Skipped = 2, 5
	if st != want {
		t.Errorf("default stats %+v, want %+v", st, want)
	}
}

func listenUnix(path string) (func(), error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return func() { unix.Close(fd) }, nil
}

func TestDirNotADirectory(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "f"), "x", 0o644)
	s := casstoretest.NewStore(t)
	for _, p := range []string{filepath.Join(dir, "f"), filepath.Join(dir, "missing")} {
		if _, _, err := Dir(t.Context(), s, p, Options{}); err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("Dir(%s) err = %v, want an error naming it", p, err)
		}
	}
	if n := len(objects(t, s)); n != 0 {
		t.Errorf("store holds %d objects after failed ingests", n)
	}
}

// eioFile is a FUSE file whose reads fail with EIO: a read error that happens even to
// root, which chmod 000 cannot produce.
type eioFile struct{ fs.Inode }

func (*eioFile) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o644
	out.Size = 4096
	return 0
}

func (*eioFile) Open(context.Context, uint32) (fs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (*eioFile) Read(context.Context, fs.FileHandle, []byte, int64) (fuse.ReadResult, syscall.Errno) {
	return nil, syscall.EIO
}

// unreadableTree returns a directory holding good files and one file, bad.bin, whose
// reads fail. As root it is a FUSE mount (root reads anything chmod 000 guards);
// otherwise the file is chmod 000.
func unreadableTree(t *testing.T) (dir, bad string) {
	t.Helper()
	if os.Geteuid() != 0 {
		dir = t.TempDir()
		for i := range 20 {
			writeFile(t, filepath.Join(dir, fmt.Sprintf("ok%02d.txt", i)), fmt.Sprintf("fine %d", i), 0o644)
		}
		writeFile(t, filepath.Join(dir, "sub", "bad.bin"), "secret", 0o000)
		return dir, filepath.Join(dir, "sub", "bad.bin")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no /dev/fuse: %v", err)
	}
	dir = t.TempDir()
	root := &fs.Inode{}
	srv, err := fs.Mount(dir, root, &fs.Options{
		MountOptions: fuse.MountOptions{FsName: "tidepool-eio-test", DirectMount: true},
		OnAdd: func(ctx context.Context) {
			for i := range 20 {
				f := &fs.MemRegularFile{Data: []byte(fmt.Sprintf("fine %d", i)), Attr: fuse.Attr{Mode: 0o644}}
				root.AddChild(fmt.Sprintf("ok%02d.txt", i), root.NewPersistentInode(ctx, f, fs.StableAttr{}), false)
			}
			sub := root.NewPersistentInode(ctx, &fs.Inode{}, fs.StableAttr{Mode: syscall.S_IFDIR})
			root.AddChild("sub", sub, false)
			sub.AddChild("bad.bin", sub.NewPersistentInode(ctx, &eioFile{}, fs.StableAttr{}), false)
		},
	})
	if err != nil {
		t.Skipf("cannot mount FUSE: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("unmount FUSE: %v", err)
		}
	})
	return dir, filepath.Join(dir, "sub", "bad.bin")
}

func TestUnreadableFileAborts(t *testing.T) {
	dir, bad := unreadableTree(t)
	s := casstoretest.NewStore(t)
	before := objects(t, s)
	for _, strict := range []bool{false, true} {
		_, _, err := Dir(t.Context(), s, dir, Options{LunarStrict: strict})
		if err == nil {
			t.Fatal("ingest of a tree with an unreadable file succeeded")
		}
		if !strings.Contains(err.Error(), bad) {
			t.Errorf("error %q does not name %s", err, bad)
		}
		if after := objects(t, s); !slices.Equal(before, after) {
			t.Errorf("store changed by a failed ingest: %v -> %v", before, after)
		}
	}
}

// manyFiles makes a tree with n small distinct files spread over a few directories.
func manyFiles(t testing.TB, n int) string {
	t.Helper()
	dir := t.TempDir()
	for i := range n {
		writeFile(t, filepath.Join(dir, fmt.Sprintf("d%d", i%7), fmt.Sprintf("e%d", i%3), fmt.Sprintf("f%04d", i)),
			strings.Repeat(fmt.Sprint(i), 1+i%50), os.FileMode(0o644|(i%2)*0o100))
	}
	return dir
}

func TestCancelLeavesStoreUnchanged(t *testing.T) {
	dir := manyFiles(t, 300)
	s := casstoretest.NewStore(t)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, _, err := Dir(ctx, s, dir, Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled before start: err = %v", err)
	}

	ctx, cancel = context.WithCancel(t.Context())
	defer cancel()
	// The first progress report always comes before the batch commits (at the latest
	// when the walk is done), so cancelling there always lands mid-ingest.
	_, _, err := Dir(ctx, s, dir, Options{Workers: 1, Progress: func(Progress) { cancel() }})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled midway: err = %v", err)
	}
	if n := len(objects(t, s)); n != 0 {
		t.Errorf("cancelled ingests left %d objects", n)
	}
}

func TestProgressReportsTotals(t *testing.T) {
	dir := manyFiles(t, 200)
	s := casstoretest.NewStore(t)
	var mu sync.Mutex
	var seen []Progress
	_, st, err := Dir(t.Context(), s, dir, Options{Progress: func(p Progress) {
		mu.Lock()
		seen = append(seen, p)
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(seen) == 0 {
		t.Fatal("progress never called")
	}
	for i := 1; i < len(seen); i++ {
		if seen[i].Files < seen[i-1].Files || seen[i].Bytes < seen[i-1].Bytes {
			t.Fatalf("progress went backwards: %+v then %+v", seen[i-1], seen[i])
		}
	}
	last := seen[len(seen)-1]
	want := Progress{Files: st.Files, Bytes: st.Bytes, FoundFiles: st.Files, FoundBytes: st.Bytes, WalkDone: true}
	if last != want || st.Files != 200 {
		t.Fatalf("final progress %+v, stats %+v; want %+v with 200 files", last, st, want)
	}
}

// TestConcurrentIngests: many ingests of one tree into one store at once agree on the
// root, and the store ends up consistent (every object verifies, the tree reads back).
func TestConcurrentIngests(t *testing.T) {
	dir := manyFiles(t, 150)
	writeFile(t, filepath.Join(dir, "big.bin"), strings.Repeat("0123456789abcdef", 1<<17), 0o644) // 2 MiB: the streaming path
	s := casstoretest.NewStore(t)
	const n = 8
	roots := make([]casstore.Hash, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h, _, err := Dir(t.Context(), s, dir, Options{Workers: 1 + i%4, LunarStrict: i%2 == 0})
			roots[i] = h
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for i := range roots {
		if roots[i] != roots[0] {
			t.Fatalf("ingest %d gave %s, ingest 0 gave %s", i, roots[i], roots[0])
		}
	}
	objs := objects(t, s)
	for _, o := range objs {
		h, _ := casstore.ParseHash(o)
		if err := s.Verify(h); err != nil {
			t.Error(err)
		}
	}
	if got := len(listing(t, s, roots[0])); got != 150+1+7+7*3 {
		t.Errorf("root lists %d entries, want %d", got, 150+1+7+7*3)
	}
	// A fresh ingest into the populated store changes nothing.
	if h := mustDir(t, s, dir, Options{}); h != roots[0] {
		t.Fatalf("re-ingest gave %s, want %s", h, roots[0])
	}
	if again := objects(t, s); !slices.Equal(objs, again) {
		t.Errorf("re-ingest changed the store: %d -> %d objects", len(objs), len(again))
	}
}

package imagebuild

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	iarchive "github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/platforms"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func needRoot(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("imagebuild lays layers out on disk with their owners: needs root")
	}
}

// unpack builds spec, imports the archive with containerd's importer (as `ctr
// images import` does) and applies the layers, bottom first, to a new directory
// with containerd's applier. It returns the directory and the image config.
func unpack(t *testing.T, spec Spec) (string, ocispec.Image) {
	t.Helper()
	needRoot(t)
	var buf bytes.Buffer
	_, err := Build(spec, &buf)
	must(t, err)
	ctx, root := context.Background(), t.TempDir()
	cs, err := local.NewStore(t.TempDir())
	must(t, err)
	index, err := iarchive.ImportIndex(ctx, cs, &buf)
	must(t, err)
	mf, err := images.Manifest(ctx, cs, index, platforms.Default())
	must(t, err)
	var cfg ocispec.Image
	p, err := content.ReadBlob(ctx, cs, mf.Config)
	must(t, err)
	must(t, json.Unmarshal(p, &cfg))
	for _, l := range mf.Layers {
		blob, err := content.ReadBlob(ctx, cs, l)
		must(t, err)
		_, err = archive.Apply(ctx, root, bytes.NewReader(blob))
		must(t, err)
	}
	return root, cfg
}

// describe gives the mode, owner, mtime year and link target or content of root/p.
func describe(root, p string) string {
	p = filepath.Join(root, p)
	fi, err := os.Lstat(p)
	if err != nil {
		return err.Error()
	}
	st := fi.Sys().(*syscall.Stat_t)
	data, _ := os.Readlink(p)
	if fi.Mode().IsRegular() {
		content, _ := os.ReadFile(p)
		data = string(content)
	}
	return strings.TrimSpace(fmt.Sprintf("%v %d:%d %d %s", fi.Mode(), st.Uid, st.Gid, fi.ModTime().Year(), data))
}

func hostTree(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	must(t, os.Chmod(dir, 0o711))
	must(t, os.MkdirAll(filepath.Join(dir, "sub"), 0o750))
	must(t, os.WriteFile(filepath.Join(dir, "a.txt"), []byte("alpha"), 0o640))
	must(t, os.Symlink("../a.txt", filepath.Join(dir, "sub", "link")))
	return dir
}

func TestBuildModesOwnersAndLinks(t *testing.T) {
	host := hostTree(t)
	root, cfg := unpack(t, Spec{Layers: []Layer{{
		File("/etc/motd", []byte("hello\n"), 0o644), File("/usr/bin/su", []byte("suid"), 0o755|fs.ModeSetuid),
		Dir("/tmp", 0o777|fs.ModeSticky), Symlink("/bin/sh", "busybox"),
		HostFile("/opt/a.txt", filepath.Join(host, "sub", "link")).Owner(1000, 1001), HostFile("/srv/tree", host).Owner(7, 8),
	}, {File("/etc/motd", []byte("bye\n"), 0o600), File("/../../var/x", nil, 0o644)}}, Config: ocispec.ImageConfig{Cmd: []string{"sh"}}})

	if c := cfg.Config; cfg.OS != "linux" || c.WorkingDir != "/" || strings.Join(c.Env, " ") != DefaultPath || c.Cmd[0] != "sh" {
		t.Fatalf("config: %+v", cfg)
	}
	for p, want := range map[string]string{
		"etc": "drwxr-xr-x 0:0 2000", "etc/motd": "-rw------- 0:0 2000 bye", "usr/bin": "drwxr-xr-x 0:0 2000",
		"usr/bin/su": "urwxr-xr-x 0:0 2000 suid", "tmp": "dtrwxrwxrwx 0:0 2000", "bin/sh": "Lrwxrwxrwx 0:0 2000 busybox",
		"opt/a.txt": "-rw-r----- 1000:1001 2000 alpha", "srv/tree": "drwx--x--x 7:8 2000", "srv/tree/a.txt": "-rw-r----- 7:8 2000 alpha",
		"srv/tree/sub": "drwxr-x--- 7:8 2000", "srv/tree/sub/link": "Lrwxrwxrwx 7:8 2000 ../a.txt",
		"var/x": "-rw-r--r-- 0:0 2000", // a path that climbs with .. stays inside the image
	} {
		if got := describe(root, p); got != want {
			t.Errorf("%s: %q, want %q", p, got, want)
		}
	}
}

func TestBuildRefusesBadSpecs(t *testing.T) {
	needRoot(t)
	for name, l := range map[string]Layer{
		"relative path":     {File("etc/x", nil, 0)},
		"root":              {Dir("/", 0)},
		"duplicate":         {File("/a", nil, 0), File("/a/", nil, 0)},
		"child of a file":   {File("/a", nil, 0), File("/a/b", nil, 0)},
		"child of a link":   {Symlink("/a", "/etc"), File("/a/b", nil, 0)},
		"missing host file": {HostFile("/a", "/nonexistent/tidepool/file")},
		"empty symlink":     {Symlink("/a", "")},
		"unknown kind":      {{Path: "/a"}},
	} {
		if _, err := Build(Spec{Layers: []Layer{l}}, io.Discard); err == nil {
			t.Errorf("%s: Build succeeded", name)
		}
	}
}

func TestCachedReusesAndInvalidates(t *testing.T) {
	needRoot(t)
	host, cache := hostTree(t), t.TempDir()
	spec := Spec{Layers: []Layer{{HostFile("/data", host), File("/b", []byte("b"), 0)}}}
	a1, err := Cached(spec, cache)
	must(t, err)
	st1, err := os.Stat(a1.Path)
	must(t, err)
	a2, err := Cached(spec, cache)
	must(t, err)
	if st2, err := os.Stat(a2.Path); err != nil || !os.SameFile(st1, st2) {
		t.Fatalf("second Cached call rebuilt: %s then %s (%v)", a1.Path, a2.Path, err)
	}
	// Entry order changes the key, not the image: a new archive, byte for byte the same.
	a3, err := Cached(Spec{Layers: []Layer{{spec.Layers[0][1], spec.Layers[0][0]}}}, cache)
	must(t, err)
	b1, err1 := os.ReadFile(a1.Path)
	b3, err3 := os.ReadFile(a3.Path)
	if err := errors.Join(err1, err3); err != nil || a3.Path == a1.Path || !bytes.Equal(b1, b3) {
		t.Fatalf("reordered entries: %s and %s differ (%v)", a1.Path, a3.Path, err)
	}
	// Rewriting a host file gives a new key and a new archive.
	must(t, os.WriteFile(filepath.Join(host, "a.txt"), []byte("beta!"), 0o640))
	future := time.Now().Add(time.Hour)
	must(t, os.Chtimes(filepath.Join(host, "a.txt"), future, future))
	if a4, err := Cached(spec, cache); err != nil || a4.Path == a1.Path {
		t.Fatalf("a changed host file reused the old archive: %v", err)
	}
	if leftovers, _ := filepath.Glob(filepath.Join(cache, ".*")); len(leftovers) != 0 {
		t.Fatalf("temporary files left in the cache: %v", leftovers)
	}
}

func TestPauseExitsZeroOnSIGTERM(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	spec, err := Pause(ctx)
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	must(t, err)
	bin := filepath.Join(t.TempDir(), "pause")
	must(t, os.WriteFile(bin, spec.Layers[0][0].Data, 0o755))
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		// A Go program's runtime catches every signal from its first instant
		// and applies the default action until signal.Notify runs, so a signal
		// that arrives during start-up kills it: give it longer on each try.
		var err error
		for try := 1; try <= 3 && (try == 1 || err != nil); try++ {
			cmd := exec.Command(bin)
			must(t, cmd.Start())
			time.Sleep(time.Duration(try) * 200 * time.Millisecond)
			must(t, cmd.Process.Signal(sig))
			timer := time.AfterFunc(10*time.Second, func() { _ = cmd.Process.Kill() })
			err = cmd.Wait()
			timer.Stop()
		}
		if err != nil {
			t.Fatalf("pause after %v: %v", sig, err)
		}
	}
}

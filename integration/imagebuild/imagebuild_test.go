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
	for i, l := range mf.Layers {
		if l.Digest != cfg.RootFS.DiffIDs[i] {
			t.Fatalf("layer %d: digest %s, diff ID %s", i, l.Digest, cfg.RootFS.DiffIDs[i])
		}
		blob, err := content.ReadBlob(ctx, cs, l)
		must(t, err)
		_, err = archive.Apply(ctx, root, bytes.NewReader(blob))
		must(t, err)
	}
	return root, cfg
}

// describe gives the mode, owner, mtime and link target of root/p.
func describe(root, p string) string {
	fi, err := os.Lstat(filepath.Join(root, p))
	if err != nil {
		return err.Error()
	}
	st := fi.Sys().(*syscall.Stat_t)
	target, _ := os.Readlink(filepath.Join(root, p))
	return strings.TrimSpace(fmt.Sprintf("%v %d:%d %d %s", fi.Mode(), st.Uid, st.Gid, fi.ModTime().Year(), target))
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
		File("/etc/motd", []byte("hello\n"), 0), File("/usr/bin/su", []byte("suid"), 0o755|fs.ModeSetuid),
		Dir("/tmp", 0o777|fs.ModeSticky), Symlink("/bin/sh", "busybox"),
		HostFile("/opt/a.txt", filepath.Join(host, "sub", "link")).Owner(1000, 1001), HostFile("/srv/tree", host).Owner(7, 8),
	}, {File("/etc/motd", []byte("bye\n"), 0o600)}}, Config: ocispec.ImageConfig{Cmd: []string{"sh"}}})

	if c := cfg.Config; cfg.OS != "linux" || c.WorkingDir != "/" || strings.Join(c.Env, " ") != DefaultPath || c.Cmd[0] != "sh" {
		t.Fatalf("config: %+v", cfg)
	}
	for p, want := range map[string]string{
		"etc": "drwxr-xr-x 0:0 2000", "etc/motd": "-rw------- 0:0 2000", "usr/bin": "drwxr-xr-x 0:0 2000",
		"usr/bin/su": "urwxr-xr-x 0:0 2000", "tmp": "dtrwxrwxrwx 0:0 2000", "bin/sh": "Lrwxrwxrwx 0:0 2000 busybox",
		"opt/a.txt": "-rw-r----- 1000:1001 2000", "srv/tree": "drwx--x--x 7:8 2000", "srv/tree/a.txt": "-rw-r----- 7:8 2000",
		"srv/tree/sub": "drwxr-x--- 7:8 2000", "srv/tree/sub/link": "Lrwxrwxrwx 7:8 2000 ../a.txt",
	} {
		if got := describe(root, p); got != want {
			t.Errorf("%s: %s, want %s", p, got, want)
		}
	}
	for p, want := range map[string]string{"etc/motd": "bye\n", "usr/bin/su": "suid", "opt/a.txt": "alpha"} {
		if got, err := os.ReadFile(filepath.Join(root, p)); err != nil || string(got) != want {
			t.Errorf("%s holds %q (%v), want %q", p, got, err, want)
		}
	}
}

func TestBuildIsDeterministic(t *testing.T) {
	needRoot(t)
	spec := Spec{Layers: []Layer{{HostFile("/data", hostTree(t)), File("/b", []byte("b"), 0)}, {File("/c", []byte("c"), 0)}}}
	var a1, a2 bytes.Buffer
	d1, err := Build(spec, &a1)
	must(t, err)
	spec.Layers[0][0], spec.Layers[0][1] = spec.Layers[0][1], spec.Layers[0][0] // order does not matter
	d2, err := Build(spec, &a2)
	must(t, err)
	if !bytes.Equal(a1.Bytes(), a2.Bytes()) || d1.Digest != d2.Digest {
		t.Fatalf("two builds of one spec differ: %s vs %s", d1.Digest, d2.Digest)
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
	// A path that climbs with .. stays inside the image.
	root, _ := unpack(t, Spec{Layers: []Layer{{File("/../../etc/x", []byte("x"), 0)}}})
	if got := describe(root, "etc/x"); got != "-rw-r--r-- 0:0 2000" {
		t.Fatalf("etc/x: %s", got)
	}
}

func TestCachedReusesAndInvalidates(t *testing.T) {
	needRoot(t)
	host, cache := hostTree(t), t.TempDir()
	spec := Spec{Layers: []Layer{{HostFile("/data", host)}}}
	a1, err := Cached(spec, cache)
	must(t, err)
	st1, err := os.Stat(a1.Path)
	must(t, err)
	a2, err := Cached(spec, cache)
	must(t, err)
	if st2, err := os.Stat(a2.Path); err != nil || !os.SameFile(st1, st2) {
		t.Fatalf("second Cached call rebuilt: %s then %s (%v)", a1.Path, a2.Path, err)
	}
	// Rewriting a host file gives a new key and a new archive.
	must(t, os.WriteFile(filepath.Join(host, "a.txt"), []byte("beta!"), 0o640))
	future := time.Now().Add(time.Hour)
	must(t, os.Chtimes(filepath.Join(host, "a.txt"), future, future))
	if a3, err := Cached(spec, cache); err != nil || a3.Path == a1.Path {
		t.Fatalf("a changed host file reused the old archive: %v", err)
	}
	if leftovers, _ := filepath.Glob(filepath.Join(cache, ".*")); len(leftovers) != 0 {
		t.Fatalf("temporary files left in the cache: %v", leftovers)
	}
}

func TestBusyboxImage(t *testing.T) {
	spec, err := Busybox()
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	must(t, err)
	root, _ := unpack(t, spec)
	list, err := exec.Command(busyboxHostPath, "--list").Output()
	must(t, err)
	for _, a := range BusyboxApplets { // each is a link, and an applet of this busybox
		if got := describe(root, "bin/"+a); got != "Lrwxrwxrwx 0:0 2000 busybox" || !strings.Contains("\n"+string(list), "\n"+a+"\n") {
			t.Errorf("applet %s: %s", a, got)
		}
	}
	for p, want := range map[string]string{"tmp": "dtrwxrwxrwx 0:0 2000", "bin/busybox": "-rwxr-xr-x 0:0 2000",
		"workspace": "drwxr-xr-x 1000:1000 2000", "home/agent": "drwxr-xr-x 1000:1000 2000"} {
		if got := describe(root, p); got != want {
			t.Errorf("%s: %s, want %s", p, got, want)
		}
	}
}

func TestPauseExitsZeroOnSIGTERM(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin, err := pauseBinary(ctx, t.TempDir())
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	must(t, err)
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
	if out, err := exec.Command("file", bin).Output(); err == nil && !strings.Contains(string(out), "statically linked") {
		t.Fatalf("pause is not static: %s", out)
	}
}

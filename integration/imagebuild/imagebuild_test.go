package imagebuild

import (
	"archive/tar"
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
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// build builds spec (as root: the layers carry owners) and imports the archive
// with containerd's importer, as `ctr images import` does; it returns the
// manifest, the config and each layer's uncompressed tar.
func build(t *testing.T, spec Spec) (ocispec.Manifest, ocispec.Image, [][]*tar.Header, [][]byte) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("imagebuild lays layers out on disk with their owners: needs root")
	}
	var buf bytes.Buffer
	desc, err := Build(spec, &buf)
	must(t, err)
	ctx := context.Background()
	cs, err := local.NewStore(t.TempDir())
	must(t, err)
	index, err := archive.ImportIndex(ctx, cs, &buf)
	must(t, err)
	mf, err := images.Manifest(ctx, cs, index, platforms.Default())
	must(t, err)
	if got, err := images.Children(ctx, cs, index); err != nil || len(got) != 1 || got[0].Digest != desc.Digest || got[0].Platform == nil {
		t.Fatalf("index lists %+v (%v), Build returned %+v", got, err, desc)
	}
	var cfg ocispec.Image
	p, err := content.ReadBlob(ctx, cs, mf.Config)
	must(t, err)
	must(t, json.Unmarshal(p, &cfg))
	if len(cfg.RootFS.DiffIDs) != len(mf.Layers) {
		t.Fatalf("%d diff IDs for %d layers", len(cfg.RootFS.DiffIDs), len(mf.Layers))
	}
	var hdrs [][]*tar.Header
	var data [][]byte
	for i, l := range mf.Layers {
		blob, err := content.ReadBlob(ctx, cs, l)
		must(t, err)
		r, err := compression.DecompressStream(bytes.NewReader(blob))
		must(t, err)
		plain, err := io.ReadAll(r)
		must(t, err)
		if digest.FromBytes(plain) != cfg.RootFS.DiffIDs[i] {
			t.Fatalf("layer %d: diff ID is not the digest of the uncompressed tar", i)
		}
		var hs []*tar.Header
		var contents bytes.Buffer
		tr := tar.NewReader(bytes.NewReader(plain))
		for h, err := tr.Next(); err != io.EOF; h, err = tr.Next() {
			must(t, err)
			hs = append(hs, h)
			_, err = io.Copy(&contents, tr)
			must(t, err)
		}
		hdrs, data = append(hdrs, hs), append(data, contents.Bytes())
	}
	return mf, cfg, hdrs, data
}

func hostTree(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	must(t, os.Chmod(dir, 0o711))
	must(t, os.MkdirAll(filepath.Join(dir, "sub", "deep"), 0o750))
	must(t, os.Chmod(filepath.Join(dir, "sub"), 0o750))
	must(t, os.WriteFile(filepath.Join(dir, "a.txt"), []byte("alpha"), 0o640))
	must(t, os.WriteFile(filepath.Join(dir, "sub", "deep", "tool"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Symlink("../a.txt", filepath.Join(dir, "sub", "link")))
	return dir
}

func TestBuildWritesAnImportableLayout(t *testing.T) {
	host := hostTree(t)
	mf, cfg, layers, data := build(t, Spec{Layers: []Layer{{
		File("/etc/motd", []byte("hello\n"), 0), File("/usr/bin/su", []byte("suid"), 0o755|fs.ModeSetuid),
		Dir("/tmp", 0o777|fs.ModeSticky), Symlink("/bin/sh", "busybox"),
		HostFile("/opt/a.txt", filepath.Join(host, "a.txt")).Owner(1000, 1001), HostDir("/srv/tree", host).Owner(7, 8),
	}, {Whiteout("/etc/motd"), File("/tmp/x", nil, 0o600)}}, Config: ocispec.ImageConfig{Cmd: []string{"sh"}}})

	if c := cfg.Config; cfg.OS != "linux" || c.WorkingDir != "/" || strings.Join(c.Env, " ") != DefaultPath || c.Cmd[0] != "sh" {
		t.Fatalf("config: %+v", cfg)
	}
	if len(mf.Layers) != 2 || mf.Layers[0].MediaType != ocispec.MediaTypeImageLayer {
		t.Fatalf("layers: %+v", mf.Layers)
	}
	want := map[string]string{ // name: type mode uid:gid link
		"etc/": "5 755 0:0", "etc/motd": "0 644 0:0", "usr/": "5 755 0:0", "usr/bin/": "5 755 0:0",
		"usr/bin/su": "0 4755 0:0", "tmp/": "5 1777 0:0", "bin/": "5 755 0:0", "bin/sh": "2 777 0:0 busybox",
		"opt/": "5 755 0:0", "opt/a.txt": "0 640 1000:1001", "srv/": "5 755 0:0", "srv/tree/": "5 711 7:8",
		"srv/tree/a.txt": "0 640 7:8", "srv/tree/sub/": "5 750 7:8", "srv/tree/sub/deep/": "5 750 7:8",
		"srv/tree/sub/deep/tool": "0 755 7:8", "srv/tree/sub/link": "2 777 7:8 ../a.txt",
	}
	seen := map[string]bool{}
	for _, h := range layers[0] {
		got := strings.TrimSpace(fmt.Sprintf("%c %o %d:%d %s", h.Typeflag, h.Mode, h.Uid, h.Gid, h.Linkname))
		if want[h.Name] != got || !h.ModTime.Equal(Epoch) || h.Uname != "" || h.Gname != "" {
			t.Errorf("%s: %s mtime %v user %q:%q; want %q at %v", h.Name, got, h.ModTime, h.Uname, h.Gname, want[h.Name], Epoch)
		}
		if dir := filepath.Dir(strings.TrimSuffix(h.Name, "/")); dir != "." && !seen[dir+"/"] {
			t.Errorf("%s comes before its parent directory", h.Name)
		}
		seen[h.Name] = true
	}
	if len(seen) != len(want) {
		t.Errorf("layer 0 has %d entries, want %d", len(seen), len(want))
	}
	if string(data[0]) != "hello\nalphaalpha#!/bin/sh\nsuid" {
		t.Errorf("layer 0 contents: %q", data[0])
	}
	// Layer 1: the whiteout, and /tmp repeated with the mode layer 0 gave it.
	var names []string
	for _, h := range layers[1] {
		names = append(names, fmt.Sprintf("%s:%o", h.Name, h.Mode))
	}
	if got := strings.Join(names, " "); got != "etc/:755 etc/.wh.motd:600 tmp/:1777 tmp/x:600" {
		t.Errorf("layer 1 entries: %s", got)
	}
}

func TestBuildIsDeterministic(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root")
	}
	host := hostTree(t)
	spec := Spec{Layers: []Layer{{HostDir("/data", host), File("/b", []byte("b"), 0)}, {File("/c", []byte("c"), 0)}}}
	var a1, a2 bytes.Buffer
	r1, err := Build(spec, &a1)
	must(t, err)
	spec.Layers[0][0], spec.Layers[0][1] = spec.Layers[0][1], spec.Layers[0][0] // order does not matter
	r2, err := Build(spec, &a2)
	must(t, err)
	if !bytes.Equal(a1.Bytes(), a2.Bytes()) || r1.Digest != r2.Digest {
		t.Fatalf("two builds of one spec differ: %s vs %s", r1.Digest, r2.Digest)
	}
	_, plain, _, _ := build(t, spec)
	spec.Gzip = true
	mf, gz, _, _ := build(t, spec) // checks the diff IDs against the decompressed layers
	for i, d := range mf.Layers {
		if d.MediaType != ocispec.MediaTypeImageLayerGzip || gz.RootFS.DiffIDs[i] != plain.RootFS.DiffIDs[i] {
			t.Fatalf("gzip layer %d: %s, diff ID %s, uncompressed %s", i, d.MediaType, gz.RootFS.DiffIDs[i], plain.RootFS.DiffIDs[i])
		}
	}
}

func TestBuildRefusesBadSpecs(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root")
	}
	for name, l := range map[string]Layer{
		"relative path":     {File("etc/x", nil, 0)},
		"root":              {Dir("/", 0)},
		"duplicate":         {File("/a", nil, 0), File("/a", nil, 0)},
		"child of a file":   {File("/a", nil, 0), File("/a/b", nil, 0)},
		"missing host file": {HostFile("/a", "/nonexistent/tidepool/file")},
		"host dir as file":  {HostFile("/a", "/")},
		"empty symlink":     {Symlink("/a", "")},
		"unknown kind":      {{Path: "/a"}},
	} {
		if _, err := Build(Spec{Layers: []Layer{l}}, io.Discard); err == nil {
			t.Errorf("%s: Build succeeded", name)
		}
	}
	// A path that climbs with .. stays inside the image.
	_, _, layers, _ := build(t, Spec{Layers: []Layer{{File("/../../etc/x", []byte("x"), 0)}}})
	if len(layers[0]) != 2 || layers[0][0].Name != "etc/" || layers[0][1].Name != "etc/x" {
		t.Fatalf("entries: %+v", layers[0])
	}
}

func TestCachedReusesAndInvalidates(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root")
	}
	host, cache := hostTree(t), t.TempDir()
	spec := Spec{Layers: []Layer{{HostDir("/data", host)}}}
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

func TestParseLdd(t *testing.T) {
	libs, err := parseLdd("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x1)\n" +
		"\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x2)\n\t/lib64/ld-linux-x86-64.so.2 (0x3)\n")
	want := "/lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libstdc++.so.6 /lib64/ld-linux-x86-64.so.2"
	if got := strings.Join(libs, " "); err != nil || got != want {
		t.Fatalf("parseLdd = %s, %v; want %s", got, err, want)
	}
	if _, err := parseLdd("\tlibfoo.so.1 => not found\n"); err == nil {
		t.Fatal("a missing library was not reported")
	}
	if libs, err := parseLdd("\tstatically linked\n"); err != nil || len(libs) != 0 {
		t.Fatalf("static binary: %v %v", libs, err)
	}
}

func TestBusyboxImageContents(t *testing.T) {
	spec, err := Busybox()
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	must(t, err)
	_, _, layers, data := build(t, spec)
	entries := map[string]*tar.Header{}
	for _, h := range layers[0] {
		entries[h.Name] = h
	}
	if h := entries["bin/busybox"]; h == nil || h.Mode&0o111 == 0 || h.Size == 0 {
		t.Fatalf("bin/busybox: %+v", h)
	}
	list, err := exec.Command(busyboxHostPath, "--list").Output()
	must(t, err)
	for _, a := range BusyboxApplets { // each is a link, and an applet of this busybox
		if h := entries["bin/"+a]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "busybox" ||
			!strings.Contains("\n"+string(list), "\n"+a+"\n") {
			t.Errorf("applet %s: %+v", a, h)
		}
	}
	if !strings.Contains(string(data[0]), "agent:x:1000:1000:") {
		t.Error("/etc/passwd lacks agent")
	}
	if h := entries["tmp/"]; h == nil || h.Mode != 0o1777 {
		t.Errorf("tmp/: %+v", h)
	}
	for _, d := range []string{"workspace/", "app/"} {
		if h := entries[d]; h == nil || h.Uid != AgentUID || h.Gid != AgentGID {
			t.Errorf("%s: %+v", d, h)
		}
	}
}

func TestPauseExitsZeroOnSIGTERM(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin, err := PauseBinary(ctx)
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

package imagebuild

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// tarEntry is one member of a tar stream, content included.
type tarEntry struct {
	hdr  *tar.Header
	data []byte
}

func readTar(t *testing.T, r io.Reader) []tarEntry {
	t.Helper()
	var out []tarEntry
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("read tar: %v", err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("read tar member %s: %v", hdr.Name, err)
		}
		out = append(out, tarEntry{hdr, data})
	}
}

// layout is a parsed OCI layout archive.
type layout struct {
	files    map[string][]byte
	index    ocispec.Index
	manifest ocispec.Manifest
	config   ocispec.Image
}

func parseLayout(t *testing.T, archive []byte) layout {
	t.Helper()
	l := layout{files: map[string][]byte{}}
	for _, e := range readTar(t, bytes.NewReader(archive)) {
		if e.hdr.Typeflag == tar.TypeReg {
			l.files[e.hdr.Name] = e.data
		}
	}
	if got := string(l.files["oci-layout"]); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout = %q", got)
	}
	mustJSON(t, l.files["index.json"], &l.index)
	if l.index.MediaType != ocispec.MediaTypeImageIndex || len(l.index.Manifests) != 1 {
		t.Fatalf("index.json: %+v", l.index)
	}
	md := l.index.Manifests[0]
	if md.MediaType != ocispec.MediaTypeImageManifest || md.Platform == nil || md.Platform.OS != "linux" {
		t.Fatalf("manifest descriptor: %+v", md)
	}
	mustJSON(t, l.blob(t, md), &l.manifest)
	if l.manifest.MediaType != ocispec.MediaTypeImageManifest || l.manifest.SchemaVersion != 2 ||
		l.manifest.Config.MediaType != ocispec.MediaTypeImageConfig {
		t.Fatalf("manifest: %+v", l.manifest)
	}
	mustJSON(t, l.blob(t, l.manifest.Config), &l.config)
	return l
}

// blob returns a blob's bytes after checking its size and digest.
func (l layout) blob(t *testing.T, d ocispec.Descriptor) []byte {
	t.Helper()
	data, ok := l.files["blobs/sha256/"+d.Digest.Encoded()]
	if !ok {
		t.Fatalf("blob %s missing from archive", d.Digest)
	}
	if int64(len(data)) != d.Size || digest.FromBytes(data) != d.Digest {
		t.Fatalf("blob %s: size %d (want %d), digest %s", d.Digest, len(data), d.Size, digest.FromBytes(data))
	}
	return data
}

func mustJSON(t *testing.T, data []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("decode %s: %v", data, err)
	}
}

func build(t *testing.T, spec Spec) ([]byte, Result) {
	t.Helper()
	var buf bytes.Buffer
	res, err := Build(spec, &buf)
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	return buf.Bytes(), res
}

func hostTree(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	must(t, os.Chmod(dir, 0o711))
	must(t, os.MkdirAll(filepath.Join(dir, "sub", "deep"), 0o750))
	must(t, os.WriteFile(filepath.Join(dir, "a.txt"), []byte("alpha"), 0o640))
	must(t, os.WriteFile(filepath.Join(dir, "sub", "deep", "tool"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Symlink("../a.txt", filepath.Join(dir, "sub", "link")))
	return dir
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestBuildWritesAnImportableLayout(t *testing.T) {
	host := hostTree(t)
	hostFile := filepath.Join(host, "a.txt")
	spec := Spec{
		Layers: []Layer{
			{
				File("/etc/motd", []byte("hello\n"), 0),
				File("/usr/bin/su", []byte("suid"), 0o755|fs.ModeSetuid),
				Dir("/tmp", 0o777|fs.ModeSticky),
				Symlink("/bin/sh", "busybox"),
				HostFile("/opt/a.txt", hostFile).Owner(1000, 1001),
				HostDir("/srv/tree", host).Owner(7, 8),
			},
			{
				Whiteout("/etc/motd"),
				File("/tmp/x", nil, 0o600),
			},
		},
		Config: Config{Cmd: []string{"sh"}},
	}
	archive, res := build(t, spec)
	l := parseLayout(t, archive)

	if l.index.Manifests[0].Digest != res.Manifest.Digest {
		t.Fatalf("index names %s, Build returned %s", l.index.Manifests[0].Digest, res.Manifest.Digest)
	}
	if l.config.OS != "linux" || l.config.RootFS.Type != "layers" {
		t.Fatalf("config: %+v", l.config)
	}
	if got := l.config.Config; got.WorkingDir != "/" || len(got.Env) != 1 || got.Env[0] != DefaultPath || got.Cmd[0] != "sh" {
		t.Fatalf("config defaults: %+v", got)
	}
	if len(l.manifest.Layers) != 2 || len(l.config.RootFS.DiffIDs) != 2 {
		t.Fatalf("layers %d, diff_ids %d", len(l.manifest.Layers), len(l.config.RootFS.DiffIDs))
	}
	var layers [][]tarEntry
	for i, d := range l.manifest.Layers {
		if d.MediaType != ocispec.MediaTypeImageLayer {
			t.Fatalf("layer %d media type %s", i, d.MediaType)
		}
		data := l.blob(t, d)
		if digest.FromBytes(data) != l.config.RootFS.DiffIDs[i] {
			t.Fatalf("layer %d: diff_id differs from the digest of the uncompressed tar", i)
		}
		layers = append(layers, readTar(t, bytes.NewReader(data)))
	}

	type want struct {
		typ      byte
		mode     int64
		uid, gid int
		link     string
		data     string
	}
	expect := map[string]want{
		"etc/":                   {tar.TypeDir, 0o755, 0, 0, "", ""},
		"etc/motd":               {tar.TypeReg, 0o644, 0, 0, "", "hello\n"},
		"usr/":                   {tar.TypeDir, 0o755, 0, 0, "", ""},
		"usr/bin/":               {tar.TypeDir, 0o755, 0, 0, "", ""},
		"usr/bin/su":             {tar.TypeReg, 0o4755, 0, 0, "", "suid"},
		"tmp/":                   {tar.TypeDir, 0o1777, 0, 0, "", ""},
		"bin/":                   {tar.TypeDir, 0o755, 0, 0, "", ""},
		"bin/sh":                 {tar.TypeSymlink, 0o777, 0, 0, "busybox", ""},
		"opt/":                   {tar.TypeDir, 0o755, 0, 0, "", ""},
		"opt/a.txt":              {tar.TypeReg, 0o640, 1000, 1001, "", "alpha"},
		"srv/":                   {tar.TypeDir, 0o755, 0, 0, "", ""},
		"srv/tree/":              {tar.TypeDir, 0o711, 7, 8, "", ""},
		"srv/tree/a.txt":         {tar.TypeReg, 0o640, 7, 8, "", "alpha"},
		"srv/tree/sub/":          {tar.TypeDir, 0o750, 7, 8, "", ""},
		"srv/tree/sub/deep/":     {tar.TypeDir, 0o750, 7, 8, "", ""},
		"srv/tree/sub/deep/tool": {tar.TypeReg, 0o755, 7, 8, "", "#!/bin/sh\n"},
		"srv/tree/sub/link":      {tar.TypeSymlink, 0o777, 7, 8, "../a.txt", ""},
	}
	seen := map[string]bool{}
	var prev string
	for _, e := range layers[0] {
		h := e.hdr
		w, ok := expect[h.Name]
		if !ok {
			t.Errorf("unexpected entry %q in layer 0", h.Name)
			continue
		}
		seen[h.Name] = true
		if h.Typeflag != w.typ || h.Mode != w.mode || h.Uid != w.uid || h.Gid != w.gid || h.Linkname != w.link || string(e.data) != w.data {
			t.Errorf("%s: type %c mode %o owner %d:%d link %q data %q; want %+v", h.Name, h.Typeflag, h.Mode, h.Uid, h.Gid, h.Linkname, e.data, w)
		}
		if !h.ModTime.Equal(Epoch) || h.Uname != "" || h.Gname != "" {
			t.Errorf("%s: mtime %v uname %q gname %q: host metadata leaked", h.Name, h.ModTime, h.Uname, h.Gname)
		}
		if prev >= h.Name {
			t.Errorf("entries not sorted: %q after %q", h.Name, prev)
		}
		if dir := filepath.Dir(strings.TrimSuffix(h.Name, "/")); dir != "." && !seen[dir+"/"] {
			t.Errorf("%s comes before its parent directory", h.Name)
		}
		prev = h.Name
	}
	for name := range expect {
		if !seen[name] {
			t.Errorf("layer 0 lacks %s", name)
		}
	}

	// Layer 1: the whiteout, and /tmp repeated with the mode layer 0 gave it.
	var names []string
	for _, e := range layers[1] {
		names = append(names, e.hdr.Name)
		if e.hdr.Name == "tmp/" && e.hdr.Mode != 0o1777 {
			t.Errorf("implied parent tmp/ in layer 1 has mode %o, want the 1777 of layer 0", e.hdr.Mode)
		}
	}
	if got := strings.Join(names, " "); got != "etc/ etc/.wh.motd tmp/ tmp/x" {
		t.Errorf("layer 1 entries: %s", got)
	}
}

func TestBuildIsDeterministic(t *testing.T) {
	host := hostTree(t)
	spec := Spec{Layers: []Layer{{HostDir("/data", host), File("/b", []byte("b"), 0)}, {File("/c", []byte("c"), 0)}}}
	a1, r1 := build(t, spec)
	// Entry order inside a layer does not matter.
	spec.Layers[0][0], spec.Layers[0][1] = spec.Layers[0][1], spec.Layers[0][0]
	a2, r2 := build(t, spec)
	if !bytes.Equal(a1, a2) || r1.Manifest.Digest != r2.Manifest.Digest {
		t.Fatalf("two builds of one spec differ: %s vs %s", r1.Manifest.Digest, r2.Manifest.Digest)
	}

	spec.Gzip = true
	g1, gr1 := build(t, spec)
	g2, _ := build(t, spec)
	if !bytes.Equal(g1, g2) {
		t.Fatal("two gzip builds of one spec differ")
	}
	l := parseLayout(t, g1)
	for i, d := range l.manifest.Layers {
		if d.MediaType != ocispec.MediaTypeImageLayerGzip {
			t.Fatalf("layer %d media type %s", i, d.MediaType)
		}
		zr, err := gzip.NewReader(bytes.NewReader(l.blob(t, d)))
		must(t, err)
		plain, err := io.ReadAll(zr)
		must(t, err)
		if digest.FromBytes(plain) != r1.DiffIDs[i] || gr1.DiffIDs[i] != r1.DiffIDs[i] {
			t.Fatalf("layer %d: gzip diff_id %s, uncompressed %s", i, gr1.DiffIDs[i], r1.DiffIDs[i])
		}
	}
}

func TestBuildRefusesBadSpecs(t *testing.T) {
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
		t.Run(name, func(t *testing.T) {
			if _, err := Build(Spec{Layers: []Layer{l}}, io.Discard); err == nil {
				t.Fatal("Build succeeded")
			}
		})
	}
	// A path that climbs with .. stays inside the image.
	archive, _ := build(t, Spec{Layers: []Layer{{File("/../../etc/x", []byte("x"), 0)}}})
	l := parseLayout(t, archive)
	for _, e := range readTar(t, bytes.NewReader(l.blob(t, l.manifest.Layers[0]))) {
		if e.hdr.Name != "etc/" && e.hdr.Name != "etc/x" {
			t.Fatalf("entry %q escapes or is unexpected", e.hdr.Name)
		}
	}
}

func TestCachedReusesAndInvalidates(t *testing.T) {
	host := hostTree(t)
	cache := t.TempDir()
	spec := Spec{Layers: []Layer{{HostDir("/data", host)}}}
	a1, err := Cached(spec, cache)
	must(t, err)
	st1, err := os.Stat(a1.Path)
	must(t, err)
	a2, err := Cached(spec, cache)
	must(t, err)
	st2, err := os.Stat(a2.Path)
	must(t, err)
	if a1.Path != a2.Path || !os.SameFile(st1, st2) || a1.Manifest.Digest != a2.Manifest.Digest {
		t.Fatalf("second Cached call rebuilt: %s then %s", a1.Path, a2.Path)
	}
	data, err := os.ReadFile(a1.Path)
	must(t, err)
	if digest.FromBytes(parseLayout(t, data).files["blobs/sha256/"+a1.Manifest.Digest.Encoded()]) != a1.Manifest.Digest {
		t.Fatal("cached metadata does not match the archive")
	}

	// Rewriting a host file gives a new key and a new archive.
	must(t, os.WriteFile(filepath.Join(host, "a.txt"), []byte("beta!"), 0o640))
	future := time.Now().Add(time.Hour)
	must(t, os.Chtimes(filepath.Join(host, "a.txt"), future, future))
	a3, err := Cached(spec, cache)
	must(t, err)
	if a3.Path == a1.Path || a3.Manifest.Digest == a1.Manifest.Digest {
		t.Fatal("a changed host file reused the old archive")
	}
	leftovers, _ := filepath.Glob(filepath.Join(cache, ".*"))
	if len(leftovers) != 0 {
		t.Fatalf("temporary files left in the cache: %v", leftovers)
	}
}

func TestParseLdd(t *testing.T) {
	out := []byte(`	linux-vdso.so.1 (0x00007ffd)
	libstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f1)
	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)
	/lib64/ld-linux-x86-64.so.2 (0x00007f3)
`)
	libs, err := parseLdd(out)
	must(t, err)
	want := "/lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libstdc++.so.6 /lib64/ld-linux-x86-64.so.2"
	if got := strings.Join(libs, " "); got != want {
		t.Fatalf("parseLdd = %s, want %s", got, want)
	}
	if _, err := parseLdd([]byte("\tlibfoo.so.1 => not found\n")); err == nil {
		t.Fatal("a missing library was not reported")
	}
	if libs, err := parseLdd([]byte("\tstatically linked\n")); err != nil || len(libs) != 0 {
		t.Fatalf("static binary: %v %v", libs, err)
	}
}

func TestBusyboxImageContents(t *testing.T) {
	spec, err := Busybox()
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	must(t, err)
	archive, _ := build(t, spec)
	l := parseLayout(t, archive)
	entries := map[string]*tar.Header{}
	var passwd string
	for _, e := range readTar(t, bytes.NewReader(l.blob(t, l.manifest.Layers[0]))) {
		entries[e.hdr.Name] = e.hdr
		if e.hdr.Name == "etc/passwd" {
			passwd = string(e.data)
		}
	}
	if h := entries["bin/busybox"]; h == nil || h.Mode&0o111 == 0 || h.Size == 0 {
		t.Fatalf("bin/busybox: %+v", h)
	}
	for _, a := range BusyboxApplets {
		if h := entries["bin/"+a]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "busybox" {
			t.Errorf("applet %s: %+v", a, h)
		}
	}
	if !strings.Contains(passwd, "agent:x:1000:1000:") {
		t.Errorf("/etc/passwd lacks agent: %q", passwd)
	}
	if h := entries["tmp/"]; h == nil || h.Mode != 0o1777 {
		t.Errorf("tmp/: %+v", h)
	}
	for _, d := range []string{"workspace/", "app/"} {
		if h := entries[d]; h == nil || h.Uid != AgentUID || h.Gid != AgentGID {
			t.Errorf("%s: %+v", d, h)
		}
	}
	// Every applet the image links must exist in this busybox.
	list, err := exec.Command(busyboxHostPath, "--list").Output()
	must(t, err)
	have := map[string]bool{}
	for _, a := range strings.Fields(string(list)) {
		have[a] = true
	}
	for _, a := range BusyboxApplets {
		if !have[a] {
			t.Errorf("busybox has no applet %q", a)
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
		for try := 1; try <= 3; try++ {
			if err = signalPause(t, bin, sig, time.Duration(try)*200*time.Millisecond); err == nil {
				break
			}
		}
		if err != nil {
			t.Fatalf("pause after %v: %v", sig, err)
		}
	}
	out, err := exec.Command("file", bin).Output()
	if err == nil && !strings.Contains(string(out), "statically linked") {
		t.Fatalf("pause is not static: %s", out)
	}
}

// signalPause starts the pause binary, sends it sig after settle and returns
// how it exited (nil for status 0).
func signalPause(t *testing.T, bin string, sig syscall.Signal, settle time.Duration) error {
	cmd := exec.Command(bin)
	must(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	time.Sleep(settle)
	must(t, cmd.Process.Signal(sig))
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("pause ignored %v", sig)
		return nil
	}
}

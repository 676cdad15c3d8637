package imagebuild

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// Names the ready-made images are imported under by the test helpers.
const (
	BusyboxRef = "tidepool.test/busybox:latest"
	NodeRef    = "tidepool.test/node:latest"
	PauseRef   = "tidepool.test/pause:latest"
)

// agentID is the uid and gid of "agent", the images' unprivileged user.
const agentID = 1000

// ErrHostMissing marks a failure caused by something this machine lacks (the
// busybox-static package, node, npm, the go toolchain): tests skip on it.
var ErrHostMissing = errors.New("host prerequisite missing")

// hostMissing marks the failure to start a host tool that is not installed as ErrHostMissing.
func hostMissing(err error) error {
	if errors.Is(err, exec.ErrNotFound) {
		return fmt.Errorf("%w: %w", err, ErrHostMissing)
	}
	return err
}

// BusyboxApplets are the commands the Busybox image links to /bin/busybox.
var BusyboxApplets = []string{
	"sh", "ls", "cat", "echo", "sleep", "id", "mkdir", "rm", "rmdir", "mv", "cp", "test", "[",
	"wc", "grep", "sed", "find", "stat", "touch", "chmod", "chown", "ln", "dmesg", "uname",
	"true", "false", "env", "head", "tail", "sort", "diff", "md5sum", "sha256sum", "printf",
	"tee", "xargs", "cut", "tr", "readlink", "realpath", "mkfifo", "kill", "ps",
}

// busyboxHostPath is where Debian's busybox-static installs its binary.
const busyboxHostPath = "/bin/busybox"

// Busybox is a one-layer image, also the base layer of Node: a static busybox
// with applet symlinks in /bin, /etc/passwd and /etc/group with root and
// "agent" (1000:1000), /tmp (1777), and /workspace and /app owned by agent.
// Its default command is sh.
func Busybox() (Spec, error) {
	list, err := exec.Command(busyboxHostPath, "--list").Output()
	if err != nil {
		return Spec{}, fmt.Errorf("%s --list: %v (install busybox-static): %w", busyboxHostPath, err, ErrHostMissing)
	}
	l := Layer{
		HostFile("/bin/busybox", busyboxHostPath),
		File("/etc/passwd", []byte("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"), 0o644),
		File("/etc/group", []byte("root:x:0:\nagent:x:1000:\n"), 0o644),
		Dir("/root", 0o700),
		Dir("/home/agent", 0o755).Owner(agentID, agentID),
		Dir("/tmp", 0o777|fs.ModeSticky),
		Dir("/workspace", 0o755).Owner(agentID, agentID),
		Dir("/app", 0o755).Owner(agentID, agentID),
		Dir("/proc", 0o555),
		Dir("/sys", 0o555),
		Dir("/dev", 0o755),
	}
	for _, a := range BusyboxApplets {
		if !slices.Contains(strings.Fields(string(list)), a) {
			return Spec{}, fmt.Errorf("%s has no applet %q", busyboxHostPath, a)
		}
		l = append(l, Symlink("/bin/"+a, "busybox"))
	}
	return Spec{Layers: []Layer{l}, Config: ocispec.ImageConfig{Cmd: []string{"sh"}}}, nil
}

// NodePackages are the npm packages, exact versions, installed into the Node
// image's /app/node_modules. debug@4.3.4 needs ms@2.1.2 while the app asks for
// ms@2.1.3, so the tree has a nested node_modules like real projects do.
var NodePackages = map[string]string{
	"lodash": "4.17.21",
	"debug":  "4.3.4",
	"ms":     "2.1.3",
}

// nodeIndexJS is /app/index.js, the Node image's default command.
const nodeIndexJS = `const _ = require('lodash');
const ms = require('ms');
const debug = require('debug');
console.log(JSON.stringify({lodash: _.VERSION, ms: ms('2h'), debug: typeof debug}));
`

// Node is the Busybox layer plus a second layer with the host's node binary
// (at the path `command -v node` gives), every shared library ldd lists and the
// dynamic loader at their host paths, and /app with package.json, index.js and
// a node_modules tree installed from the npm registry (cached under
// <repo>/.cache/npm). Its default command is `node /app/index.js`.
func Node(ctx context.Context) (Spec, error) {
	base, err := Busybox()
	if err != nil {
		return Spec{}, err
	}
	nodePath, err := exec.LookPath("node")
	if err != nil {
		return Spec{}, fmt.Errorf("node: %v: %w", err, ErrHostMissing)
	}
	libs, err := sharedLibraries(ctx, nodePath)
	if err != nil {
		return Spec{}, err
	}
	app, err := npmTree(ctx)
	if err != nil {
		return Spec{}, err
	}
	l := Layer{
		HostFile(nodePath, nodePath),
		Dir("/app", 0o755).Owner(agentID, agentID),
		HostFile("/app/package.json", filepath.Join(app, "package.json")),
		HostFile("/app/package-lock.json", filepath.Join(app, "package-lock.json")),
		HostFile("/app/node_modules", filepath.Join(app, "node_modules")),
		File("/app/index.js", []byte(nodeIndexJS), 0o644),
	}
	for _, lib := range libs {
		l = append(l, HostFile(lib, lib))
	}
	return Spec{
		Layers: []Layer{base.Layers[0], l},
		Config: ocispec.ImageConfig{Cmd: []string{"node", "/app/index.js"}, WorkingDir: "/app"},
	}, nil
}

// sharedLibraries lists the absolute paths of the libraries and loader a
// dynamic executable needs, as ldd resolves them on this host. ldd prints
// "name => /path (addr)", "/loader (addr)", and entries without a file (the
// vDSO) that need nothing copied.
func sharedLibraries(ctx context.Context, bin string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", bin, hostMissing(err))
	}
	var libs []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "not found") {
			return nil, fmt.Errorf("ldd %s: %s", bin, strings.TrimSpace(line))
		}
		if _, after, ok := strings.Cut(line, "=>"); ok {
			line = after
		}
		if p, _, _ := strings.Cut(strings.TrimSpace(line), " ("); strings.HasPrefix(p, "/") {
			libs = append(libs, p)
		}
	}
	slices.Sort(libs)
	return slices.Compact(libs), nil
}

// npmTree returns a directory holding package.json, package-lock.json and the
// installed node_modules of NodePackages, running npm install once per package
// set and keeping the result under the cache.
func npmTree(ctx context.Context) (string, error) {
	var deps []string
	for _, n := range slices.Sorted(maps.Keys(NodePackages)) {
		deps = append(deps, fmt.Sprintf("    %q: %q", n, NodePackages[n]))
	}
	pkg := "{\n  \"name\": \"tidepool-test-app\",\n  \"version\": \"1.0.0\",\n  \"private\": true,\n" +
		"  \"dependencies\": {\n" + strings.Join(deps, ",\n") + "\n  }\n}\n"
	sum := sha256.Sum256([]byte(pkg))
	cache, err := testenv.CacheDir("npm")
	if err != nil {
		return "", err
	}
	return cacheEntry(cache, "app-"+hex.EncodeToString(sum[:8]), func(dir string) error {
		if err := errors.Join(os.Mkdir(dir, 0o755), os.WriteFile(filepath.Join(dir, "package.json"), []byte(pkg), 0o644)); err != nil {
			return err
		}
		cmd := exec.CommandContext(ctx, "npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", "--cache", filepath.Join(cache, "_npm-cache"))
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("npm install: %w: %s", hostMissing(err), bytes.TrimSpace(out))
		}
		return nil
	})
}

// Pause is an image holding only /pause, a static Go binary built from
// integration/imagebuild/pause that blocks, reaps children and exits 0 on
// SIGTERM or SIGINT: the sandbox image for CRI tests. Go builds are
// reproducible, so building it again each time keeps the image's cache key.
func Pause(ctx context.Context) (Spec, error) {
	dir, err := os.MkdirTemp("", "imagebuild-pause-")
	if err != nil {
		return Spec{}, fmt.Errorf("pause image: %w", err)
	}
	defer os.RemoveAll(dir)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", filepath.Join(dir, "pause"), testenv.ModulePath+"/integration/imagebuild/pause")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if msg, err := cmd.CombinedOutput(); err != nil {
		return Spec{}, fmt.Errorf("build pause: %w: %s", hostMissing(err), bytes.TrimSpace(msg))
	}
	data, err := os.ReadFile(filepath.Join(dir, "pause"))
	if err != nil {
		return Spec{}, fmt.Errorf("pause image: %w", err)
	}
	return Spec{Layers: []Layer{{File("/pause", data, 0o755)}}, Config: ocispec.ImageConfig{Entrypoint: []string{"/pause"}}}, nil
}

// BusyboxArchive returns the cached archive of Busybox, building it if needed.
// It skips the test when the host lacks what the image copies (busybox-static;
// node and npm for Node; the go toolchain for Pause) and fails it on other errors.
func BusyboxArchive(t testing.TB) Archive {
	t.Helper()
	return archiveFor(t, func(context.Context) (Spec, error) { return Busybox() })
}

// NodeArchive is BusyboxArchive for Node (the first call on a machine runs npm install).
func NodeArchive(t testing.TB) Archive { t.Helper(); return archiveFor(t, Node) }

// PauseArchive is BusyboxArchive for Pause.
func PauseArchive(t testing.TB) Archive { t.Helper(); return archiveFor(t, Pause) }

// SpecArchive is the archive of spec (say, one of the images above with more layers),
// built if needed and cached in <repo>/.cache/images (or $TIDEPOOL_CACHE_DIR/images).
func SpecArchive(t testing.TB, spec Spec) Archive {
	t.Helper()
	dir, err := testenv.CacheDir("images")
	if err != nil {
		t.Fatalf("image: %v", err)
	}
	a, err := Cached(spec, dir)
	if err != nil {
		t.Fatalf("build image: %v", err)
	}
	return a
}

func archiveFor(t testing.TB, spec func(context.Context) (Spec, error)) Archive {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s, err := spec(ctx)
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	if err != nil {
		t.Fatalf("image: %v", err)
	}
	return SpecArchive(t, s)
}

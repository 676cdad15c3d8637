package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// CRINamespace is the containerd namespace the CRI plugin works in.
const CRINamespace = "k8s.io"

// instancePrefix starts the name of every instance directory (and namespace).
const instancePrefix = "tph-"

// Containerd is a private containerd for one test: its own root, state,
// sockets, shim socket dir and namespace, all under Dir.
type Containerd struct {
	// Dir holds everything of the instance; removed by the cleanup.
	Dir string
	// Root and State are containerd's root and state directories.
	Root, State string
	// Address is the gRPC socket, TTRPCAddress the ttrpc one.
	Address, TTRPCAddress string
	// Namespace is unique to this instance (it is Dir's base name); Ctr and
	// Client use it. Its runc state (/run/containerd/runc/<ns>) and cgroups
	// (/<ns>/<container> in every hierarchy) are therefore its own too.
	Namespace string
	// ConfigPath is the generated config.toml, LogPath containerd's log.
	ConfigPath, LogPath string
	// FIFODir is where task FIFOs should go instead of the shared
	// /run/containerd/fifo: pass `--fifo-dir` to ctr run / task start / task
	// exec, or cio.WithFIFODir to the Go client.
	FIFODir string
	// RuncRoot is runc's root for CRI runtimes (the runc options Root).
	RuncRoot string

	opts   Options
	daemon *Daemon
	lock   *os.File // flock held while this instance lives (see sweepStale)

	mu      sync.Mutex
	closers []func() error // clients to close at cleanup
	record  instanceRecord
}

// paths are the file names of an instance.
type paths struct {
	dir, root, state, socketDir, address, ttrpcAddress, runcRoot, fifoDir, config, log string
}

func newPaths(dir string) paths {
	return paths{
		dir:          dir,
		root:         filepath.Join(dir, "root"),
		state:        filepath.Join(dir, "state"),
		socketDir:    filepath.Join(dir, "s"),
		address:      filepath.Join(dir, "c.sock"),
		ttrpcAddress: filepath.Join(dir, "c.ttrpc"),
		runcRoot:     filepath.Join(dir, "runc"),
		fifoDir:      filepath.Join(dir, "fifo"),
		config:       filepath.Join(dir, "config.toml"),
		log:          filepath.Join(dir, "containerd.log"),
	}
}

// instanceBase is where instance directories go: $TMPDIR when short, else
// /tmp. Unix socket paths must fit in 108 bytes and containerd refuses a shim
// socket_dir longer than 42 (it appends a 64-hex-digit name).
func instanceBase() string {
	if d := os.TempDir(); len(d) <= 16 {
		return d
	}
	return "/tmp"
}

// StartContainerd starts a private containerd (the pinned 2.4.2) and waits
// until its socket answers. The registered cleanup always stops it, kills the
// shims and containers it left, unmounts what is mounted under its directory,
// removes the cgroups and runc state of its containers and deletes the
// directory; when the test failed it prints the tail of containerd's log (and
// copies the whole log into t.ArtifactDir()). It skips the test when not root
// or when the tools are missing.
func StartContainerd(t testing.TB, opts Options) *Containerd {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.RequireTools(t, "containerd", "ctr", "containerd-shim-runc-v2", "runc")
	bin, _ := testenv.Tool("containerd")
	if opts.LogLevel == "" {
		opts.LogLevel = "debug"
	}
	if opts.SandboxImage == "" {
		opts.SandboxImage = imagebuild.PauseRef
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 30 * time.Second
	}
	base := instanceBase()
	sweepOnce.Do(func() {
		for _, msg := range sweepStale(base) {
			t.Logf("harness: %s", msg)
		}
	})

	dir, err := os.MkdirTemp(base, instancePrefix)
	if err != nil {
		t.Fatalf("containerd instance dir: %v", err)
	}
	p := newPaths(dir)
	c := &Containerd{
		Dir: dir, Root: p.root, State: p.state,
		Address: p.address, TTRPCAddress: p.ttrpcAddress,
		Namespace:  filepath.Base(dir),
		ConfigPath: p.config, LogPath: p.log,
		FIFODir: p.fifoDir, RuncRoot: p.runcRoot,
		opts: opts,
	}
	c.record = instanceRecord{Dir: dir, Address: c.Address, TTRPCAddress: c.TTRPCAddress, Namespace: c.Namespace}
	t.Cleanup(func() { c.cleanup(t) })
	if err := c.prepare(p); err != nil {
		t.Fatalf("containerd instance: %v", err)
	}
	c.daemon = NewDaemon(DaemonSpec{
		Name:         "containerd",
		Path:         bin,
		Args:         []string{"--config", p.config},
		Env:          c.environ(),
		Dir:          dir,
		LogPath:      p.log,
		Ready:        c.ready,
		ReadyTimeout: opts.StartTimeout,
	})
	if err := c.daemon.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if opts.CRI && opts.SandboxImage == imagebuild.PauseRef {
		c.ImportImageInNamespace(t, CRINamespace, imagebuild.PauseArchive(t).Path, imagebuild.PauseRef)
	}
	return c
}

// prepare takes the instance lock, records the instance and writes the config.
func (c *Containerd) prepare(p paths) error {
	lock, err := os.OpenFile(filepath.Join(p.dir, ".lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	c.lock = lock
	if err := c.saveRecord(); err != nil {
		return err
	}
	// Runtimes that drop privileges inside the instance (gVisor's sandbox runs as
	// nobody and builds its chroot under containerd's temp dir) must be able to
	// traverse the instance directory and use its temp dir, as with /tmp.
	if err := os.Chmod(p.dir, 0o711); err != nil {
		return err
	}
	for _, d := range []string{p.root, p.state, p.socketDir, p.fifoDir, filepath.Join(p.dir, "tmp")} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return err
		}
	}
	// tmp is the instance's containerd `temp` directory, which stands in for the /tmp
	// a host's containerd uses by default: sticky and world-writable like /tmp, a test
	// fixture only (no socket lives there; the instance directory above is 0711).
	if err := os.Chmod(filepath.Join(p.dir, "tmp"), 0o1777); err != nil {
		return err
	}
	cfg, err := renderConfig(p, c.opts)
	if err != nil {
		return err
	}
	return os.WriteFile(p.config, cfg, 0o644)
}

// environ is containerd's environment: the test's, minus variables that would
// point it (or ctr) elsewhere, with PATH putting the project's binaries and the
// pinned tools first, then Options.Env.
func (c *Containerd) environ() []string {
	env := map[string]string{}
	var order []string
	set := func(kv string) {
		k, v, _ := strings.Cut(kv, "=")
		if _, ok := env[k]; !ok {
			order = append(order, k)
		}
		env[k] = v
	}
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "CONTAINERD_") || k == "NOTIFY_SOCKET" {
			continue
		}
		set(kv)
	}
	set("PATH=" + testenv.SearchPath())
	for _, kv := range c.opts.Env {
		set(kv)
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+env[k])
	}
	return out
}

// ready succeeds once the gRPC socket answers a Version call.
func (c *Containerd) ready(ctx context.Context) error {
	if _, err := os.Stat(c.Address); err != nil {
		return err
	}
	cl, err := client.New(c.Address, client.WithTimeout(2*time.Second))
	if err != nil {
		return err
	}
	defer cl.Close()
	_, err = cl.Version(ctx)
	return err
}

// Client returns a Go client for this instance with Namespace as its default
// namespace, after a Version round trip. The cleanup closes it.
func (c *Containerd) Client(ctx context.Context) (*client.Client, error) {
	cl, err := client.New(c.Address, client.WithDefaultNamespace(c.Namespace), client.WithTimeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("containerd client: %w", err)
	}
	if _, err := cl.Version(ctx); err != nil {
		cl.Close()
		return nil, fmt.Errorf("containerd client: %w", err)
	}
	c.mu.Lock()
	c.closers = append(c.closers, cl.Close)
	c.mu.Unlock()
	return cl, nil
}

// Context returns ctx set to this instance's namespace, for Go client calls.
func (c *Containerd) Context(ctx context.Context) context.Context {
	return namespaces.WithNamespace(ctx, c.Namespace)
}

// ctrTimeout bounds a Ctr call.
const ctrTimeout = 2 * time.Minute

// Ctr runs `ctr --address <Address> --namespace <Namespace> args...` and
// returns its stdout. The error names the command and carries its stderr.
func (c *Containerd) Ctr(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), ctrTimeout)
	defer cancel()
	return c.CtrContext(ctx, "", args...)
}

// CtrContext is Ctr in another namespace ("" for Namespace), bounded by ctx.
func (c *Containerd) CtrContext(ctx context.Context, namespace string, args ...string) (string, error) {
	if namespace == "" {
		namespace = c.Namespace
	}
	ctr, err := testenv.Tool("ctr")
	if err != nil {
		return "", err
	}
	full := append([]string{"--address", c.Address, "--namespace", namespace}, args...)
	cmd := exec.CommandContext(ctx, ctr, full...)
	cmd.Env = c.environ()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// Pid is containerd's process id (0 while stopped).
func (c *Containerd) Pid() int { return c.daemon.Pid() }

// Stop stops containerd (SIGTERM, SIGKILL after 10s). Shims and their
// containers keep running, as they do when a real containerd stops.
func (c *Containerd) Stop() error { return c.daemon.Stop() }

// Kill kills containerd with SIGKILL, as a crash would.
func (c *Containerd) Kill() error { return c.daemon.Kill() }

// Restart stops containerd if it runs and starts it again on the same root,
// state and config: images, containers and running tasks are kept.
func (c *Containerd) Restart() error {
	if err := c.daemon.Stop(); err != nil {
		return err
	}
	return c.daemon.Start(context.Background())
}

// TrackCgroup makes the cleanup remove a cgroup (a path relative to the
// hierarchy roots, e.g. a CRI pod's cgroup_parent) in every hierarchy, after
// killing what runs in it. Container cgroups named in bundles and /<Namespace>
// are removed without being tracked.
func (c *Containerd) TrackCgroup(path string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.record.Cgroups = append(c.record.Cgroups, path)
	return c.saveRecordLocked()
}

func (c *Containerd) saveRecord() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.saveRecordLocked()
}

func (c *Containerd) saveRecordLocked() error {
	data, err := json.Marshal(c.record)
	if err != nil {
		return err
	}
	tmp := filepath.Join(c.Dir, "instance.json.tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("record instance: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(c.Dir, "instance.json")); err != nil {
		return fmt.Errorf("record instance: %w", err)
	}
	return nil
}

// cleanup runs at the end of the test that started the instance.
func (c *Containerd) cleanup(t testing.TB) {
	c.mu.Lock()
	for _, closeClient := range c.closers {
		_ = closeClient()
	}
	c.closers = nil
	rec := c.record
	c.mu.Unlock()

	if c.daemon != nil {
		if err := c.daemon.Close(); err != nil {
			t.Errorf("containerd: %v", err)
		}
	}
	if t.Failed() {
		t.Logf("last lines of containerd's log:\n%s", tailFile(c.LogPath, 80))
		keepLog(t, c.LogPath)
	}
	for _, err := range cleanupInstance(rec) {
		t.Errorf("harness cleanup: %v", err)
	}
	if c.lock != nil {
		c.lock.Close()
	}
}

// keepLog copies a log into the test's artifact directory (kept with
// `go test -artifacts`).
func keepLog(t testing.TB, path string) {
	src, err := os.Open(path)
	if err != nil {
		return
	}
	defer src.Close()
	dst, err := os.Create(filepath.Join(t.ArtifactDir(), filepath.Base(path)))
	if err != nil {
		t.Logf("keep %s: %v", path, err)
		return
	}
	defer dst.Close()
	if _, err := io.Copy(dst, src); err != nil {
		t.Logf("keep %s: %v", path, err)
	}
}

// ImportImage imports an OCI archive into Namespace as the image name, and
// unpacks it for each snapshotter (for containerd's default, overlayfs, when
// none is given). It fails the test on error.
//
// How `ctr images import` (transfer service, the default) names and unpacks:
// --index-name N stores the archive's index.json as image N; without it, a
// manifest gets the name in its io.containerd.image.name annotation (a full
// reference), or its org.opencontainers.image.ref.name (a tag) prefixed with
// --base-name or "import-<date>". imagebuild archives carry no name, so
// --index-name alone decides. It unpacks for --snapshotter (default overlayfs)
// unless --no-unpack; importing again unpacks for another snapshotter and
// reuses the content.
func (c *Containerd) ImportImage(t testing.TB, archive, name string, snapshotters ...string) {
	t.Helper()
	c.ImportImageInNamespace(t, "", archive, name, snapshotters...)
}

// ImportImageInNamespace is ImportImage into another namespace (CRINamespace
// for images CRI should see).
func (c *Containerd) ImportImageInNamespace(t testing.TB, namespace, archive, name string, snapshotters ...string) {
	t.Helper()
	if err := c.importImage(namespace, archive, name, snapshotters); err != nil {
		t.Fatal(err)
	}
}

func (c *Containerd) importImage(namespace, archive, name string, snapshotters []string) error {
	if len(snapshotters) == 0 {
		snapshotters = []string{""}
	}
	for _, sn := range snapshotters {
		// The archive's index.json becomes the image (--index-name): the
		// archive itself carries no name. Importing again only unpacks.
		args := []string{"images", "import", "--index-name", name}
		if sn != "" {
			args = append(args, "--snapshotter", sn)
		}
		if _, err := c.CtrContext(context.Background(), namespace, append(args, archive)...); err != nil {
			return fmt.Errorf("import %s as %s: %w", archive, name, err)
		}
	}
	names, err := c.CtrContext(context.Background(), namespace, "images", "ls", "--quiet")
	if err != nil {
		return fmt.Errorf("import %s as %s: %w", archive, name, err)
	}
	if !slices.Contains(strings.Split(names, "\n"), name) {
		return fmt.Errorf("import %s: no image %s afterwards (images: %q)", archive, name, names)
	}
	return nil
}

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/transfer"
	tarchive "github.com/containerd/containerd/v2/core/transfer/archive"
	"github.com/containerd/containerd/v2/core/transfer/image"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/platforms"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/hostcheck"
	"github.com/tidepool-dev/tidepool/shim"
)

// doctorNamespace holds the probe image of the transfer check while it runs; it is
// removed afterwards.
const doctorNamespace = binding.DoctorNamespace

// containerdFacts is what the containerd checks learnt, for the checks after them.
type containerdFacts struct {
	client  *client.Client
	pid     int
	path    string            // containerd's PATH (from its environment)
	exports map[string]string // the proxy snapshotter's exports
	plugins map[string]bool   // "type.id" of every plugin that loaded
}

func (d *doctor) checkContainerd(ctx context.Context) (out []hostcheck.Check, facts containerdFacts) {
	c := hostcheck.Check{Name: "containerd", Required: true,
		Fix: "start containerd >= 2.3 (systemctl start containerd), or pass --containerd-address"}
	// Without containerd, every check that asks it is missing too: say so, one line each.
	unreachable := func(err error) []hostcheck.Check {
		out := []hostcheck.Check{fail(c, hostcheck.Missing, fmt.Errorf("%s: %w", d.containerdAddress, err))}
		for _, name := range []string{"containerd proxy plugin " + d.snapshotter, "containerd transfer unpack for " + d.snapshotter, "containerd runtime " + shim.RuntimeName} {
			out = append(out, hostcheck.Check{Name: name, Required: true, Status: hostcheck.Missing, Detail: "containerd not reachable", Fix: c.Fix})
		}
		return out
	}
	cl, err := client.New(d.containerdAddress, client.WithTimeout(5*time.Second))
	if err != nil {
		return unreachable(err), facts
	}
	v, err := cl.Version(ctx)
	if err != nil {
		cl.Close()
		return unreachable(err), facts
	}
	facts.client = cl
	c.Detail = v.Version + " at " + d.containerdAddress
	if v.Revision != "" {
		c.Detail = fmt.Sprintf("%s (%s) at %s", v.Version, v.Revision, d.containerdAddress)
	}
	if major, minor := parseVersion(v.Version); major < 2 || (major == 2 && minor < 3) {
		c.Status, c.Fix = hostcheck.Missing, "the tidepool shim needs containerd >= 2.3: upgrade containerd"
	} else {
		c.Status, c.Fix = hostcheck.OK, ""
	}
	out = append(out, c)

	if srv, err := cl.IntrospectionService().Server(ctx); err == nil {
		facts.pid = int(srv.GetPid())
		facts.path = processPath(facts.pid)
	}
	facts.plugins = map[string]bool{}
	resp, err := cl.IntrospectionService().Plugins(ctx)
	if err != nil {
		return append(out, fail(hostcheck.Check{Name: "containerd plugins", Required: true}, hostcheck.Missing, err)), facts
	}
	var proxy hostcheck.Check
	proxy = hostcheck.Check{Name: "containerd proxy plugin " + d.snapshotter, Required: true,
		Fix: "tidepool install (writes [proxy_plugins." + d.snapshotter + "] in a drop-in containerd imports), then restart containerd"}
	proxy.Status, proxy.Detail = hostcheck.Missing, "containerd's running config loads no snapshotter named "+d.snapshotter
	for _, p := range resp.GetPlugins() {
		if p.GetInitErr() == nil {
			facts.plugins[p.GetType()+"."+p.GetID()] = true
		}
		if p.GetType() != "io.containerd.snapshotter.v1" || p.GetID() != d.snapshotter {
			continue
		}
		if e := p.GetInitErr(); e != nil {
			proxy.Detail = "loaded with an error: " + e.GetMessage()
			break
		}
		facts.exports = p.GetExports()
		proxy.Status, proxy.Fix = hostcheck.OK, ""
		proxy.Detail = fmt.Sprintf("snapshotter %s (root %s, capabilities %v)", d.snapshotter, p.GetExports()["root"], p.GetCapabilities())
	}
	out = append(out, proxy)
	if proxy.OK() {
		out = append(out, d.checkUnpack(ctx, cl))
	} else {
		out = append(out, hostcheck.Check{Name: "containerd transfer unpack for " + d.snapshotter, Required: true, Status: hostcheck.Missing,
			Detail: "no " + d.snapshotter + " snapshotter to unpack into", Fix: proxy.Fix})
	}
	out = append(out, d.checkRuntime(ctx, cl))
	out = append(out, d.checkCRI(ctx, facts))
	return out, facts
}

// checkUnpack imports a tiny one-layer image through containerd's transfer service
// asking it to unpack for the tidepool snapshotter (as `ctr images import
// --snapshotter tidepool` and `ctr images pull` do), then looks for the layer's
// snapshot. Without an unpack_config entry for the snapshotter, containerd 2.4
// refuses the import ("no unpack platforms defined") when no entry matches at all,
// and skips the snapshotter silently when another entry matches, so only the
// snapshot's presence proves the entry is there. Everything it creates lives in a
// namespace of its own, under a lease, and is removed afterwards.
func (d *doctor) checkUnpack(ctx context.Context, cl *client.Client) hostcheck.Check {
	c := hostcheck.Check{Name: "containerd transfer unpack for " + d.snapshotter, Required: true,
		Fix: `add [[plugins."io.containerd.transfer.v1.local".unpack_config]] with snapshotter = "` + d.snapshotter + `" (tidepool install does), then restart containerd`}
	img, err := newProbeImage()
	if err != nil {
		return fail(c, hostcheck.Degraded, err)
	}
	ctx = namespaces.WithNamespace(ctx, doctorNamespace)
	ls := cl.LeasesService()
	lease, err := ls.Create(ctx, leases.WithRandomID(), leases.WithExpiration(10*time.Minute))
	if err != nil {
		return fail(c, hostcheck.Degraded, err)
	}
	ctx = leases.WithLease(ctx, lease.ID)
	name := "tidepool-doctor/probe:" + img.chainID.Encoded()[:12]
	sn := cl.SnapshotService(d.snapshotter)
	defer func() {
		// A fresh context: cleanup must run even if ctx was cancelled. Deleting
		// the lease synchronously collects what it held (content written by a
		// failed import too), so the namespace is empty and can go.
		cctx := namespaces.WithNamespace(context.Background(), doctorNamespace)
		sn.Remove(cctx, img.chainID.String())
		cl.ImageService().Delete(cctx, name, images.SynchronousDelete())
		ls.Delete(cctx, lease, leases.SynchronousDelete)
		// containerd's collector ignores deletions that land while a collection
		// runs, so what the lease held may outlive it for a moment: ask for
		// another synchronous collection (an empty lease's deletion) and retry.
		var err error
		for i := 0; i < 20; i++ {
			if err = cl.NamespaceService().Delete(cctx, doctorNamespace); err == nil || errdefs.IsNotFound(err) {
				return
			}
			if l, lerr := ls.Create(cctx, leases.WithRandomID()); lerr == nil {
				ls.Delete(cctx, l, leases.SynchronousDelete)
			}
			time.Sleep(100 * time.Millisecond)
		}
		log.G(cctx).WithError(err).Warnf("doctor: namespace %s left behind", doctorNamespace)
	}()
	plat := platforms.DefaultSpec()
	store := image.NewStore(name, image.WithPlatforms(plat), image.WithUnpack(plat, d.snapshotter))
	src := tarchive.NewImageImportStream(bytes.NewReader(img.archive), "")
	if err := cl.Transfer(ctx, src, store, transfer.WithProgress(func(transfer.Progress) {})); err != nil {
		if strings.Contains(err.Error(), "no unpack platforms") {
			return fail(c, hostcheck.Missing, fmt.Errorf("the transfer service has no unpack entry for %s on %s (an import asking for it failed: %w)", d.snapshotter, platforms.Format(plat), err))
		}
		return fail(c, hostcheck.Missing, fmt.Errorf("import through the transfer service: %w", err))
	}
	if _, err := sn.Stat(ctx, img.chainID.String()); err != nil {
		if errdefs.IsNotFound(err) {
			return fail(c, hostcheck.Missing, fmt.Errorf("the transfer service has no unpack entry for %s on %s (an image imported for it was not unpacked there)", d.snapshotter, platforms.Format(plat)))
		}
		return fail(c, hostcheck.Missing, fmt.Errorf("stat the probe layer in %s: %w", d.snapshotter, err))
	}
	c.Status, c.Fix = hostcheck.OK, ""
	c.Detail = "an imported image was unpacked into " + d.snapshotter + " (" + platforms.Format(plat) + ")"
	return c
}

// checkRuntime asks containerd for the runtime's info: containerd resolves
// io.containerd.tidepool.v1 to containerd-shim-tidepool-v1 on its own PATH and runs
// it with -info, exactly as it will to start a container.
func (d *doctor) checkRuntime(ctx context.Context, cl *client.Client) hostcheck.Check {
	c := hostcheck.Check{Name: "containerd runtime " + shim.RuntimeName, Required: true,
		Fix: "install containerd-shim-tidepool-v1 on containerd's PATH (tidepool install puts it in /usr/local/bin)"}
	info, err := cl.RuntimeInfo(ctx, shim.RuntimeName, nil)
	if err != nil {
		return fail(c, hostcheck.Missing, err)
	}
	c.Status, c.Fix = hostcheck.OK, ""
	c.Detail = strings.TrimSpace(info.Name + " " + info.Version.Version)
	return c
}

// checkCRI asks the CRI plugin (when loaded) for its runtime handlers and config.
func (d *doctor) checkCRI(ctx context.Context, facts containerdFacts) hostcheck.Check {
	c := hostcheck.Check{Name: "CRI runtime handler " + d.handler,
		Fix: "tidepool install (adds [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes." + d.handler + "]), then restart containerd"}
	if !facts.plugins["io.containerd.grpc.v1.cri"] {
		c.Status, c.Detail, c.Fix = hostcheck.Degraded, "the CRI plugin is not loaded (fine for ctr and nerdctl; Kubernetes needs it)", "enable containerd's CRI plugin for Kubernetes nodes"
		return c
	}
	c.Required = true // a CRI node without the handler cannot run tidepool pods
	conn, err := grpc.NewClient("unix://"+d.containerdAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fail(c, hostcheck.Degraded, err)
	}
	defer conn.Close()
	st, err := runtimeapi.NewRuntimeServiceClient(conn).Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		return fail(c, hostcheck.Degraded, fmt.Errorf("CRI Status: %w", err))
	}
	var names []string
	for _, h := range st.GetRuntimeHandlers() {
		names = append(names, h.GetName())
	}
	if !slices.Contains(names, d.handler) {
		return fail(c, hostcheck.Missing, fmt.Errorf("CRI runtime handlers are %v", names))
	}
	// The verbose config says what the handler runs.
	var cfg struct {
		Containerd struct {
			Runtimes map[string]struct {
				Type        string `json:"runtimeType"`
				Snapshotter string `json:"snapshotter"`
			} `json:"runtimes"`
		} `json:"containerd"`
	}
	if raw := st.GetInfo()["config"]; raw != "" && json.Unmarshal([]byte(raw), &cfg) == nil {
		if r, ok := cfg.Containerd.Runtimes[d.handler]; ok {
			if r.Type != shim.RuntimeName || r.Snapshotter != d.snapshotter {
				return fail(c, hostcheck.Degraded, fmt.Errorf("handler %s runs %q on snapshotter %q, want %s on %s", d.handler, r.Type, r.Snapshotter, shim.RuntimeName, d.snapshotter))
			}
		}
	}
	c.Status, c.Fix = hostcheck.OK, ""
	c.Detail = fmt.Sprintf("handler %s -> %s on snapshotter %s", d.handler, shim.RuntimeName, d.snapshotter)
	return c
}

// checkRoutes looks up every route of the shim's routing table on containerd's PATH
// (shims inherit containerd's environment): the default route is required, the
// others are reported.
func (d *doctor) checkRoutes(facts containerdFacts) []hostcheck.Check {
	cfg, err := shim.LoadConfig(nil)
	if err != nil {
		return []hostcheck.Check{fail(hostcheck.Check{Name: "shim routes", Required: true, Fix: "fix " + shim.DefaultConfigPath}, hostcheck.Missing, err)}
	}
	path, from := facts.path, fmt.Sprintf("containerd's PATH (pid %d)", facts.pid)
	if path == "" {
		path, from = os.Getenv("PATH"), "this process's PATH (containerd's is unknown)"
	}
	var out []hostcheck.Check
	for _, name := range cfg.Names() {
		r := cfg.Runtimes[name]
		c := hostcheck.Check{Name: "route " + name, Required: name == cfg.DefaultRuntime}
		bin := r.BinaryName
		if r.Kind == shim.KindShim {
			bin = r.Shim
		} else if bin == "" {
			bin = "runc"
		}
		p, err := lookPathIn(bin, path)
		if err != nil {
			c.Status, c.Detail = hostcheck.Missing, fmt.Sprintf("%s not found in %s", bin, from)
			switch {
			case r.Kind == shim.KindShim:
				c.Fix = "install the delegate shim " + bin + " (for kata-fc: Kata Containers with Firecracker, e.g. kata-deploy)"
			case bin == "runsc":
				c.Fix = "install gVisor's runsc (Debian: apt-get install runsc)"
			default:
				c.Fix = "install " + bin + " on containerd's PATH"
			}
			out = append(out, c)
			continue
		}
		c.Status, c.Detail = hostcheck.OK, p
		if r.Kind != shim.KindShim {
			if v := firstLine(exec.Command(p, "--version")); v != "" {
				c.Detail += " (" + v + ")"
			}
		}
		out = append(out, c)
	}
	return out
}

func firstLine(cmd *exec.Cmd) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cmd = exec.CommandContext(ctx, cmd.Path, cmd.Args[1:]...)
	b, err := cmd.Output()
	if err != nil {
		return ""
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return line
}

// processPath reads PATH from a process's environment (root can read containerd's).
func processPath(pid int) string {
	if pid <= 0 {
		return ""
	}
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "environ"))
	if err != nil {
		return ""
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("PATH=")); ok {
			return string(v)
		}
	}
	// containerd without PATH in its environment: exec uses the default search path.
	return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
}

func lookPathIn(bin, path string) (string, error) {
	if filepath.IsAbs(bin) {
		if st, err := os.Stat(bin); err != nil || st.Mode()&0o111 == 0 {
			return "", fmt.Errorf("%s is not an executable", bin)
		}
		return bin, nil
	}
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, bin)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found", bin)
}

// parseVersion reads "v2.4.2" or "2.4.2-rc.1" as 2, 4.
func parseVersion(v string) (major, minor int) {
	v = strings.TrimPrefix(v, "v")
	parts := strings.SplitN(v, ".", 3)
	if len(parts) >= 2 {
		major, _ = strconv.Atoi(parts[0])
		minor, _ = strconv.Atoi(strings.TrimFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	}
	return major, minor
}

func fail(c hostcheck.Check, st hostcheck.Status, err error) hostcheck.Check {
	c.Status, c.Detail = st, err.Error()
	return c
}

package harness

import (
	"fmt"

	"github.com/containerd/platforms"
	"path/filepath"
	"time"

	"github.com/pelletier/go-toml/v2"
)

// ProxyPlugin is a [proxy_plugins.<name>] entry: a snapshotter, content store,
// sandbox controller... served by another process over gRPC.
type ProxyPlugin struct {
	// Type is the proxy type: "snapshot", "content", "sandbox", "diff".
	Type string
	// Address is the plugin's unix socket.
	Address      string
	Exports      map[string]string
	Capabilities []string
	// Platform is the plugin's platform ("linux/amd64"); a snapshotter needs one
	// for containerd to unpack images into it. Empty means the host's.
	Platform string
}

// Runtime is a CRI runtime handler ([plugins.'io.containerd.cri.v1.runtime'
// .containerd.runtimes.<name>]), the name a RuntimeClass handler refers to.
type Runtime struct {
	// Type is runtime_type, e.g. "io.containerd.tidepool.v1", which containerd
	// resolves to the binary containerd-shim-tidepool-v1 on PATH.
	Type string
	// Path is runtime_path, an absolute shim binary (optional).
	Path                 string
	Snapshotter          string
	Sandboxer            string
	PodAnnotations       []string
	ContainerAnnotations []string
	// Options is the runtime's options table. For io.containerd.runc.v2 the
	// harness sets Root to a directory of this instance unless given.
	Options map[string]any
}

// Options configures a private containerd.
type Options struct {
	// ProxyPlugins are added as [proxy_plugins.<name>].
	ProxyPlugins map[string]ProxyPlugin
	// ExtraTOML is parsed and merged over the generated config (tables merge
	// key by key, other values replace), so it may set keys inside tables the
	// harness already writes, which plain appending could not.
	ExtraTOML string
	// CRI enables the CRI plugin (disabled otherwise, which also starts faster).
	CRI bool
	// Runtimes are CRI runtime handlers added next to the default "runc".
	Runtimes map[string]Runtime
	// SandboxImage is the pinned CRI sandbox image. It defaults to
	// imagebuild.PauseRef, which StartContainerd builds and imports into the
	// k8s.io namespace, so no registry is ever contacted.
	SandboxImage string
	// Env entries (KEY=VALUE) are added to containerd's environment, which the
	// shims it starts inherit; they override inherited variables.
	Env []string
	// LogLevel is containerd's log level (default "debug").
	LogLevel string
	// StartTimeout bounds the wait for the socket to answer (default 30s).
	StartTimeout time.Duration
}

// The CRI plugins, disabled when Options.CRI is false.
var criPlugins = []string{
	"io.containerd.grpc.v1.cri",
	"io.containerd.cri.v1.runtime",
	"io.containerd.cri.v1.images",
	"io.containerd.podsandbox.controller.v1.podsandbox",
}

// renderConfig produces config.toml (version 4, the native format of 2.4.2)
// for an instance living in dir.
func renderConfig(p paths, opts Options) ([]byte, error) {
	disabled := []string{
		// NRI would listen on the host-wide /var/run/nri/nri.sock.
		"io.containerd.nri.v1.nri",
	}
	if !opts.CRI {
		disabled = append(disabled, criPlugins...)
	}
	plugins := map[string]any{
		"io.containerd.server.v1.grpc":  map[string]any{"address": p.address},
		"io.containerd.server.v1.ttrpc": map[string]any{"address": p.ttrpcAddress},
		// Shim sockets go to /run/containerd/s unless told (max 42 bytes).
		"io.containerd.shim.v1.manager": map[string]any{"socket_dir": p.socketDir},
		"io.containerd.internal.v1.opt": map[string]any{"path": filepath.Join(p.dir, "opt")},
	}
	if opts.CRI {
		runtimes := map[string]any{
			"runc": runtimeTable(p, Runtime{Type: "io.containerd.runc.v2"}),
		}
		for name, r := range opts.Runtimes {
			runtimes[name] = runtimeTable(p, r)
		}
		plugins["io.containerd.cri.v1.runtime"] = map[string]any{
			// Root here lacks CAP_SYS_RESOURCE: the pause container's
			// oom_score_adj of -998 must be clamped to ours.
			"restrict_oom_score_adj": true,
			// Pod network namespaces under our state dir, not /var/run/netns.
			"netns_mounts_under_state_dir": true,
			"containerd": map[string]any{
				"default_runtime_name": "runc",
				"runtimes":             runtimes,
			},
			"cni": map[string]any{
				"bin_dirs": []string{filepath.Join(p.dir, "cni", "bin")},
				"conf_dir": filepath.Join(p.dir, "cni", "net.d"),
			},
		}
		plugins["io.containerd.cri.v1.images"] = map[string]any{
			"pinned_images": map[string]any{"sandbox": opts.SandboxImage},
		}
	}
	cfg := map[string]any{
		"version":          4,
		"root":             p.root,
		"state":            p.state,
		"temp":             filepath.Join(p.dir, "tmp"),
		"imports":          []string{}, // never read /etc/containerd/conf.d
		"disabled_plugins": disabled,
		"debug":            map[string]any{"level": opts.LogLevel},
		"plugins":          plugins,
	}
	if len(opts.ProxyPlugins) > 0 {
		proxies := map[string]any{}
		for name, pp := range opts.ProxyPlugins {
			t := map[string]any{"type": pp.Type, "address": pp.Address}
			if pp.Platform != "" {
				t["platform"] = pp.Platform
			} else if pp.Type == "snapshot" {
				t["platform"] = platforms.DefaultString()
			}
			if len(pp.Exports) > 0 {
				t["exports"] = pp.Exports
			}
			if len(pp.Capabilities) > 0 {
				t["capabilities"] = pp.Capabilities
			}
			proxies[name] = t
		}
		cfg["proxy_plugins"] = proxies
	}
	if opts.ExtraTOML != "" {
		var extra map[string]any
		if err := toml.Unmarshal([]byte(opts.ExtraTOML), &extra); err != nil {
			return nil, fmt.Errorf("extra TOML: %w", err)
		}
		mergeTables(cfg, extra)
	}
	out, err := toml.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("encode containerd config: %w", err)
	}
	return out, nil
}

func runtimeTable(p paths, r Runtime) map[string]any {
	t := map[string]any{"runtime_type": r.Type}
	if r.Path != "" {
		t["runtime_path"] = r.Path
	}
	if r.Snapshotter != "" {
		t["snapshotter"] = r.Snapshotter
	}
	if r.Sandboxer != "" {
		t["sandboxer"] = r.Sandboxer
	}
	if len(r.PodAnnotations) > 0 {
		t["pod_annotations"] = r.PodAnnotations
	}
	if len(r.ContainerAnnotations) > 0 {
		t["container_annotations"] = r.ContainerAnnotations
	}
	options := map[string]any{}
	for k, v := range r.Options {
		options[k] = v
	}
	if r.Type == "io.containerd.runc.v2" {
		// CRI always uses the k8s.io namespace, so with the default Root
		// (/run/containerd/runc/k8s.io) two instances would share runc state.
		if _, ok := options["Root"]; !ok {
			options["Root"] = p.runcRoot
		}
	}
	if len(options) > 0 {
		t["options"] = options
	}
	return t
}

// mergeTables merges src into dst: tables recursively, anything else replaces.
func mergeTables(dst, src map[string]any) {
	for k, v := range src {
		if sub, ok := v.(map[string]any); ok {
			if into, ok := dst[k].(map[string]any); ok {
				mergeTables(into, sub)
				continue
			}
		}
		dst[k] = v
	}
}

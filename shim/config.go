package shim

import (
	"bytes"
	"fmt"
	"os"
	"sort"
	"strings"

	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	"github.com/pelletier/go-toml/v2"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tidepool-dev/tidepool/binding"
)

// DefaultConfigPath is read when neither the runtime options nor ConfigEnv name a
// config.
const DefaultConfigPath = "/etc/tidepool/shim.toml"

// ConfigEnv names a config file through the environment containerd gives its shims
// (a systemd drop-in, say). Prefer it, or the default path, to runtime options when a
// route delegates to another shim: containerd hands that shim the same runtime
// options, and a ConfigPath meant for tidepool would be read as the delegate's own.
const ConfigEnv = "TIDEPOOL_SHIM_CONFIG"

// Route kinds.
const (
	// KindRunc serves the container in this shim with containerd's runc task
	// service; BinaryName picks the OCI runtime binary.
	KindRunc = "runc"
	// KindShim hands the container to another shim binary at start.
	KindShim = "shim"
)

// Delegate start protocols.
const (
	// ProtocolBootstrap: containerd >= 2.3 shims read BootstrapParams on stdin.
	ProtocolBootstrap = "bootstrap"
	// ProtocolLegacy: older shims (Kata's Go shim is built on containerd 1.7) read
	// the runtime options, if any, on stdin and print a plain address.
	ProtocolLegacy = "legacy"
)

// Route is one entry of the routing table.
type Route struct {
	Kind string `toml:"kind" comment:"runc: served in this shim (binary_name picks runc, crun or runsc); shim: handed to another shim binary"`
	// BinaryName is the OCI runtime binary for a runc route ("" means runc).
	BinaryName string `toml:"binary_name,omitempty" comment:"OCI runtime binary for a runc route (empty: runc)"`
	// Root is the runtime's state directory for a runc route ("" means the default).
	Root string `toml:"root,omitempty" comment:"state directory of the OCI runtime (empty: /run/containerd/runc)"`
	// Shim is the delegate shim binary for a shim route: a name looked up in PATH
	// and beside this binary, or an absolute path.
	Shim string `toml:"shim,omitempty" comment:"delegate shim binary for a shim route"`
	// Protocol is how the delegate expects to be started.
	Protocol string `toml:"protocol,omitempty" comment:"bootstrap (containerd >= 2.3 shims) or legacy (e.g. Kata's Go shim)"`
	// CreateNetns makes the network namespace a spec asks for before the runtime
	// runs, for runtimes that only join one (runsc).
	CreateNetns bool `toml:"create_netns,omitempty" comment:"create the network namespace the spec asks for (runsc expects one to exist)"`
	// Env is added to the delegate's environment (KATA_CONF_FILE, say).
	Env []string `toml:"env,omitempty" comment:"extra environment for the delegate shim"`
}

// Config is the shim's configuration.
type Config struct {
	// APIAddress is tidepoold's local API socket, used to bind forks.
	APIAddress string `toml:"api_address" comment:"tidepoold's local API socket, used to bind forks from annotations"`
	// DefaultRuntime is the route of containers without dev.tidepool.runtime.
	DefaultRuntime string `toml:"default_runtime" comment:"route for containers without a dev.tidepool.runtime annotation"`
	// Runtimes is the routing table, keyed by annotation value.
	Runtimes map[string]Route `toml:"runtimes"`
}

// DefaultConfig routes runc (default), runsc (gVisor as an OCI binary) and kata-fc
// (Kata Containers with Firecracker, as a delegate shim).
func DefaultConfig() *Config {
	return &Config{
		APIAddress:     "/run/tidepool/api.sock",
		DefaultRuntime: "runc",
		Runtimes: map[string]Route{
			"runc":  {Kind: KindRunc},
			"runsc": {Kind: KindRunc, BinaryName: "runsc", CreateNetns: true},
			"kata-fc": {
				Kind: KindShim, Shim: "containerd-shim-kata-v2", Protocol: ProtocolLegacy,
				Env: []string{"KATA_CONF_FILE=/opt/kata/share/defaults/kata-containers/configuration-fc.toml"},
			},
		},
	}
}

// ParseConfig reads TOML over the defaults; routes named in it replace the default
// route of the same name. Unknown keys are ignored, because CRI puts the whole
// runtime options table (ConfigPath and all) into the body.
func ParseConfig(b []byte) (*Config, error) {
	cfg := DefaultConfig()
	var file Config
	if err := toml.NewDecoder(bytes.NewReader(b)).Decode(&file); err != nil {
		return nil, fmt.Errorf("parse shim config: %w", err)
	}
	if file.APIAddress != "" {
		cfg.APIAddress = file.APIAddress
	}
	if file.DefaultRuntime != "" {
		cfg.DefaultRuntime = file.DefaultRuntime
	}
	for name, r := range file.Runtimes {
		cfg.Runtimes[name] = r
	}
	return cfg, cfg.Validate()
}

// Validate checks the routing table.
func (c *Config) Validate() error {
	for name, r := range c.Runtimes {
		switch r.Kind {
		case KindRunc:
		case KindShim:
			if r.Shim == "" {
				return fmt.Errorf("shim config: runtime %q: a shim route needs shim", name)
			}
			if r.Protocol != ProtocolBootstrap && r.Protocol != ProtocolLegacy {
				return fmt.Errorf("shim config: runtime %q: protocol %q is not %q or %q", name, r.Protocol, ProtocolBootstrap, ProtocolLegacy)
			}
		default:
			return fmt.Errorf("shim config: runtime %q: kind %q is not %q or %q", name, r.Kind, KindRunc, KindShim)
		}
	}
	if _, ok := c.Runtimes[c.DefaultRuntime]; !ok {
		return fmt.Errorf("shim config: default_runtime %q is not in the routing table (%s)", c.DefaultRuntime, strings.Join(c.Names(), ", "))
	}
	return nil
}

// Names lists the valid dev.tidepool.runtime values.
func (c *Config) Names() []string {
	names := make([]string, 0, len(c.Runtimes))
	for n := range c.Runtimes {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// RouteFor picks the route for a container's annotations.
func (c *Config) RouteFor(annotations map[string]string) (string, Route, error) {
	name, ok := annotations[AnnotationRuntime]
	if !ok {
		name = c.DefaultRuntime
	}
	r, found := c.Runtimes[name]
	if !found {
		return "", Route{}, fmt.Errorf("invalid %s=%q: valid values are %s: %w", AnnotationRuntime, name, strings.Join(c.Names(), ", "), errdefs.ErrInvalidArgument)
	}
	return name, r, nil
}

// AnnotationRuntime selects the route (the name is shared with the pools: binding).
const AnnotationRuntime = binding.AnnotationRuntime

// LoadConfig finds the configuration: the ConfigPath, else the ConfigBody, of the
// runtime options (ctr --runtime-config-path; CRI's runtime options table); else the
// file named by ConfigEnv; else DefaultConfigPath if it exists; else the defaults.
func LoadConfig(opts *anypb.Any) (*Config, error) {
	if opts != nil && opts.GetValue() != nil {
		v, err := typeurl.UnmarshalAny(opts)
		if err == nil {
			if ro, ok := v.(*runtimeoptions.Options); ok {
				if ro.ConfigPath != "" {
					b, err := os.ReadFile(ro.ConfigPath)
					if err != nil {
						return nil, fmt.Errorf("read shim config from runtime options: %w", err)
					}
					return ParseConfig(b)
				}
				if len(ro.ConfigBody) > 0 {
					return ParseConfig(ro.ConfigBody)
				}
			}
		}
	}
	if p := os.Getenv(ConfigEnv); p != "" {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("read shim config from $%s: %w", ConfigEnv, err)
		}
		return ParseConfig(b)
	}
	b, err := os.ReadFile(DefaultConfigPath)
	if err != nil {
		if os.IsNotExist(err) {
			cfg := DefaultConfig()
			return cfg, cfg.Validate()
		}
		return nil, fmt.Errorf("read shim config: %w", err)
	}
	return ParseConfig(b)
}

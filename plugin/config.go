package plugin

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// DefaultRoot is the state directory when none is configured.
const DefaultRoot = "/var/lib/tidepool"

// Config is Tidepool's one configuration: tidepoold reads it from its TOML file, and a
// containerd built with Tidepool as a built-in reads it from
// [plugins.'dev.tidepool.core.v1.tidepool'].
type Config struct {
	Root           string `toml:"root" comment:"State directory: cas/ (objects), forks.db, metadata.db, snapshots/, views/.\nIn a containerd built-in, empty means the plugin's root under containerd's root.\nA path through a symbolic link is used by its real path (the one the mount table shows)."`
	Address        string `toml:"address" comment:"Unix socket the snapshotter's gRPC service listens on (tidepoold only).\nPoint containerd's [proxy_plugins.tidepool] address here."`
	APIAddress     string `toml:"api_address" comment:"Unix socket of the local API (forks, bind, pools) used by the tidepool CLI and the shim."`
	MetricsAddress string `toml:"metrics_address" comment:"TCP address serving Prometheus metrics at /metrics; empty disables."`
	// ContainerdAddress is where tidepoold reaches containerd (pools, and prompt
	// collection of removed snapshots); empty disables both.
	ContainerdAddress string `toml:"containerd_address" comment:"containerd's socket, for warm pools and for asking containerd to collect removed snapshots at once (so forks advance right after a container is removed); empty: neither."`

	Store       StoreConfig       `toml:"store"`
	Snapshotter SnapshotterConfig `toml:"snapshotter"`
	Views       ViewsConfig       `toml:"views"`
	Maintenance MaintenanceConfig `toml:"maintenance"`
	// Limits bound every walk of a tree (views' directories here; the CLI has the same
	// limits as flags): a tree is a DAG, so a few objects can spell billions of paths.
	Limits casstore.Limits `toml:"limits"`
	Pools  PoolsConfig     `toml:"pools"`
	Remote RemoteConfig    `toml:"remote"`
}

// StoreConfig locates the object store.
type StoreConfig struct {
	Path string `toml:"path" comment:"Object store directory; empty means ROOT/cas. May be a LunarFS store (~/.lunar/cas)."`
}

// SnapshotterConfig tunes the snapshotter.
type SnapshotterConfig struct {
	DefaultWorkdir string   `toml:"default_workdir" comment:"Where a fork appears when the request names no workdir."`
	DefaultOwner   string   `toml:"default_owner" comment:"uid:gid owning the fork's files when the request names no owner."`
	MountOptions   []string `toml:"mount_options" comment:"Extra overlay mount options, as for containerd's overlayfs snapshotter."`
	SyncRemove     bool     `toml:"sync_remove" comment:"Remove snapshot directories during Remove instead of in containerd's cleanup."`
}

// ViewsConfig chooses how fork views are served and tunes the FUSE ones.
type ViewsConfig struct {
	Mode            string   `toml:"mode" comment:"How fork views are served: 'kernel' (a metadata-only EROFS image over the object store, read by the kernel\nalone: native speed, survives tidepoold restarts; kernel >= 6.12), 'fuse' (served by tidepoold; lazy\nhydration, late binding), or 'auto': kernel when the kernel supports it and every object of the tree is\nlocal, FUSE otherwise. Late-bound views (warm pool members) are always FUSE."`
	Passthrough     bool     `toml:"passthrough" comment:"Use FUSE passthrough (kernel >= 6.9) so reads of local blobs bypass the daemon."`
	NoOpen          bool     `toml:"no_open" comment:"Kernel open caching: no FUSE round trip per open (warm small-file reads near native), but no passthrough and\na page cache per view (N containers on one root cache each file N times). Off by default."`
	EntryTimeout    Duration `toml:"entry_timeout" comment:"How long the kernel caches names; objects never change, so long is safe."`
	AttrTimeout     Duration `toml:"attr_timeout" comment:"How long the kernel caches attributes."`
	ColdReadAheadMB int64    `toml:"cold_read_ahead_mb" comment:"When a kernel view is mounted while its image is not in the page cache (caches are cold: after a\nreboot, or under memory pressure), read ahead the data of its files in the background, in tree order (the\norder find, grep -r and compilers walk it), up to this many MiB per view, so that the container's first\npass reads from memory. Costs disk reads and page cache (which the kernel reclaims) for files it may never\nread; warm mounts cost nothing. 0 turns it off."`
	Layering        string   `toml:"layering" comment:"How a kernel view enters the container's overlay: 'direct' (its EROFS image is the overlay's top lower\nlayer and the object store its data-only layer; metacopy=on, redirect_dir=on, trusted xattrs) or 'nested'\n(the view's own overlay is the top lower layer). Snapshots over very many layers, and snapshotter mount\noptions with userxattr, metacopy or redirect_dir, get nested views either way."`
}

// MaintenanceConfig schedules background upkeep.
type MaintenanceConfig struct {
	ForkSweepInterval Duration `toml:"fork_sweep_interval" comment:"How often forks whose TTL ran out are removed."`
	GCInterval        Duration `toml:"gc_interval" comment:"How often unreferenced objects are collected; 0 disables automatic GC."`
	GCGrace           Duration `toml:"gc_grace" comment:"Objects written or used more recently than this are never collected."`
}

// PoolsConfig configures warm pools of pre-created, frozen members.
type PoolsConfig struct {
	Namespaces []string `toml:"namespaces" comment:"containerd namespaces the pools serve, for templates that name none. A container adopts a member\n(dev.tidepool.pool) only in its own namespace, where the member was unpacked from the same image, so list\nthe namespaces your containers are created in: 'default' for ctr and nerdctl, add 'k8s.io' for CRI. Each\nnamespace keeps min/target/max members of its own, needs the image present, and shows the members in\n'ctr -n NS c ls' (ids 'tidepool-POOL-...', labelled dev.tidepool.pool and dev.tidepool.member)."`
	// Namespace is the key namespaces replaced: when set, it overrides Namespaces
	// (one namespace) and tidepoold logs that it is deprecated.
	Namespace  string         `toml:"namespace,omitempty" comment:"deprecated: one namespace for every pool; overrides namespaces. Write namespaces = ['...'] instead."`
	Holder     string         `toml:"holder" comment:"tidepool-holder binary (pid 1 of members); empty: beside tidepoold."`
	ShimConfig string         `toml:"shim_config" comment:"tidepool shim config given to members' tasks; empty: the shim's default."`
	Templates  []PoolTemplate `toml:"template" comment:"One [[pools.template]] per pool, e.g.\n  [[pools.template]]\n  name = 'node'\n  image = 'registry.example/agent-node:latest'\n  namespaces = ['default', 'k8s.io']\n  runtime = 'runc'\n  workdir = '/app'\n  owner = '1000:1000'\n  cpus = 1.0\n  memory_mb = 1024\n  min = 1\n  target = 4\n  max = 8\n  refill_rate = 5.0\n  max_age = '1h0m0s'"`
}

// PoolTemplate is one pool (see pool.Template).
type PoolTemplate struct {
	Name       string   `toml:"name" comment:"pool name, used by tidepool run --pool and the dev.tidepool.pool annotation"`
	Image      string   `toml:"image" comment:"image reference, present in every namespace the pool serves"`
	Namespaces []string `toml:"namespaces,omitempty" comment:"containerd namespaces of the members (default: pools.namespaces)"`
	Runtime    string   `toml:"runtime" comment:"tidepool shim route: runc (default) or runsc"`
	Workdir    string   `toml:"workdir" comment:"where claimed forks appear (default /workspace)"`
	Owner      string   `toml:"owner" comment:"uid:gid of the fork's files (default 0:0)"`
	CPUs       float64  `toml:"cpus" comment:"CPU limit per member (0: none)"`
	MemoryMB   int64    `toml:"memory_mb" comment:"memory limit per member in MiB (0: none)"`
	Min        int      `toml:"min" comment:"never fewer idle members than this"`
	Target     int      `toml:"target" comment:"idle members kept ready"`
	Max        int      `toml:"max" comment:"idle plus claimed members at most (default 2*target)"`
	RefillRate float64  `toml:"refill_rate" comment:"members started per second at most (default 5)"`
	MaxAge     Duration `toml:"max_age" comment:"idle members older than this are recycled (default 1h)"`
	// Shim groups: idle members share shim processes (pool.Template.ShimGroupSize).
	ShimGroupSize  int      `toml:"shim_group_size,omitempty" comment:"idle members per shim process (default 100; 1: a shim per member)"`
	ShimGroupGrace Duration `toml:"shim_group_grace,omitempty" comment:"how long a group's shim stays up serving no member, so a draining pool refills into it (default 5s)"`
}

// DefaultConfig is the configuration `tidepoold --print-default-config` prints.
func DefaultConfig() *Config {
	return &Config{
		Root:           DefaultRoot,
		Address:        "/run/tidepool/snapshotter.sock",
		APIAddress:     "/run/tidepool/api.sock",
		MetricsAddress: "127.0.0.1:9840",
		Snapshotter: SnapshotterConfig{
			DefaultWorkdir: binding.DefaultWorkdir,
			DefaultOwner:   "0:0",
		},
		Views: ViewsConfig{
			Mode:            "auto",
			Layering:        "direct",
			ColdReadAheadMB: 256,
			Passthrough:     true,
			EntryTimeout:    Duration(time.Hour),
			AttrTimeout:     Duration(time.Hour),
		},
		Maintenance: MaintenanceConfig{
			ForkSweepInterval: Duration(time.Minute),
			GCInterval:        0,
			GCGrace:           Duration(time.Hour),
		},
		Limits:            casstore.DefaultLimits(),
		ContainerdAddress: "/run/containerd/containerd.sock",
		Pools: PoolsConfig{
			Namespaces: []string{"default"},
		},
		Remote: RemoteConfig{Concurrency: 32},
	}
}

// LoadConfig reads path over the defaults. A missing file is an error only when
// mustExist is set (an explicit --config).
func LoadConfig(path string, mustExist bool) (*Config, error) {
	cfg := DefaultConfig()
	b, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) && !mustExist {
			return cfg, nil
		}
		return nil, fmt.Errorf("read config: %w", err)
	}
	dec := toml.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(cfg); err != nil {
		return nil, fmt.Errorf("parse config %s: %w", path, err)
	}
	return cfg, nil
}

// Marshal renders the configuration as commented TOML.
func (c *Config) Marshal() ([]byte, error) {
	var buf bytes.Buffer
	enc := toml.NewEncoder(&buf)
	enc.SetIndentTables(true)
	if err := enc.Encode(c); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// StorePath is where the objects live.
func (c *Config) StorePath() string {
	if c.Store.Path != "" {
		return c.Store.Path
	}
	return filepath.Join(c.Root, "cas")
}

// Validate checks what can be checked before anything starts.
func (c *Config) Validate() error {
	if c.Root == "" || !filepath.IsAbs(c.Root) {
		return fmt.Errorf("config: root %q must be an absolute path", c.Root)
	}
	if err := checkLayerPath("root", c.Root); err != nil {
		return err
	}
	if err := checkLayerPath("store.path", c.Store.Path); err != nil {
		return err
	}
	if _, err := binding.ParseWorkdir(c.Snapshotter.DefaultWorkdir); err != nil {
		return fmt.Errorf("config: snapshotter.default_workdir: %w", err)
	}
	if _, _, err := binding.ParseOwner(c.Snapshotter.DefaultOwner); err != nil {
		return fmt.Errorf("config: snapshotter.default_owner: %w", err)
	}
	switch c.Views.Mode {
	case "", ModeAuto, ModeKernel, ModeFUSE:
	default:
		return fmt.Errorf("config: views.mode %q: want %q, %q or %q", c.Views.Mode, ModeAuto, ModeKernel, ModeFUSE)
	}
	if c.Views.ColdReadAheadMB < 0 {
		return fmt.Errorf("config: views.cold_read_ahead_mb %d: want 0 (off) or more", c.Views.ColdReadAheadMB)
	}
	switch c.Views.Layering {
	case "", snapshotter.LayeringDirect, snapshotter.LayeringNested:
	default:
		return fmt.Errorf("config: views.layering %q: want %q or %q", c.Views.Layering, snapshotter.LayeringDirect, snapshotter.LayeringNested)
	}
	return nil
}

// checkLayerPath refuses a directory path that overlayfs mount options cannot carry.
// A container's rootfs mount names layers under the root (and, for a kernel view
// layered directly, the store) in one option string, the way containerd passes it
// to mount(2): ',' ends an option there and ':' a layer, so such a path would fail
// every container's mount with a bare "invalid argument".
func checkLayerPath(key, p string) error {
	if i := strings.IndexAny(p, ",:"); i >= 0 {
		return fmt.Errorf("config: %s %q: a path with %q cannot be an overlayfs layer (mount options separate with ',' and layers with ':')", key, p, p[i])
	}
	return nil
}

// Duration is a time.Duration written as "1h30m" in TOML.
type Duration time.Duration

// MarshalText renders Go duration syntax.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText parses Go duration syntax.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("duration %q: %w", b, err)
	}
	*d = Duration(v)
	return nil
}

package plugin

import (
	"fmt"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/plugins"
	cplugin "github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/localapi/apiserver"
	"github.com/tidepool-dev/tidepool/pool"
)

// CorePlugin is the plugin type of the assembled Core; its ID is "tidepool".
const CorePlugin cplugin.Type = "dev.tidepool.core.v1"

// PoolPlugin is the plugin type of the warm-pool controller; its ID is "tidepool".
const PoolPlugin cplugin.Type = "dev.tidepool.pool.v1"

// ID is the plugin ID of every Tidepool registration, and the snapshotter's name.
const ID = "tidepool"

// PropertyDeferPools, set in the init context's properties, leaves the pool
// controller unstarted: tidepoold starts it (pool.Controller.Start) once its
// snapshotter socket serves and containerd reaches it, since creating or removing a
// member makes containerd call the snapshotter, and containerd does not retry a
// snapshot cleanup that failed. Built into containerd, the snapshotter is in the same
// process and the pools start at once.
const PropertyDeferPools = "dev.tidepool.pools.deferred"

func init() {
	registry.Register(&cplugin.Registration{
		Type:   CorePlugin,
		ID:     ID,
		Config: DefaultConfig(),
		InitFn: func(ic *cplugin.InitContext) (any, error) {
			cfg, ok := ic.Config.(*Config)
			if !ok {
				return nil, fmt.Errorf("tidepool: unexpected config type %T", ic.Config)
			}
			if cfg.Root == "" {
				cfg.Root = ic.Properties[plugins.PropertyRootDir]
			}
			return NewCore(ic.Context, cfg)
		},
	})
	registry.Register(&cplugin.Registration{
		Type:     plugins.SnapshotPlugin,
		ID:       ID,
		Requires: []cplugin.Type{CorePlugin},
		InitFn: func(ic *cplugin.InitContext) (any, error) {
			c, err := core(ic)
			if err != nil {
				return nil, err
			}
			ic.Meta.Exports[plugins.SnapshotterRootDir] = c.Config.Root
			ic.Meta.Capabilities = append(ic.Meta.Capabilities, snapshots.RebaseCap)
			return c.Snapshotter, nil
		},
	})
	registry.Register(&cplugin.Registration{
		Type:     PoolPlugin,
		ID:       ID,
		Requires: []cplugin.Type{CorePlugin},
		InitFn: func(ic *cplugin.InitContext) (any, error) {
			c, err := core(ic)
			if err != nil {
				return nil, err
			}
			ctrl, err := newPoolController(c)
			if err != nil {
				return nil, err
			}
			if ic.Properties[PropertyDeferPools] == "" {
				ctrl.Start(ic.Context)
			}
			return ctrl, nil
		},
	})
	registry.Register(&cplugin.Registration{
		Type:     plugins.GRPCPlugin,
		ID:       ID,
		Requires: []cplugin.Type{CorePlugin, PoolPlugin},
		InitFn: func(ic *cplugin.InitContext) (any, error) {
			c, err := core(ic)
			if err != nil {
				return nil, err
			}
			ctrl, err := ic.GetByID(PoolPlugin, ID)
			if err != nil {
				return nil, err
			}
			return &apiserver.Server{
				Forks:             c.Forks,
				Snapshotter:       c.Snapshotter,
				Pools:             ctrl.(*pool.Controller),
				Info:              &apiv1.InfoResponse{Root: c.Config.Root, Store: c.Store.Root(), SnapshotterAddress: c.Config.Address},
				ContainerdAddress: c.Config.ContainerdAddress,
			}, nil
		},
	})
}

func core(ic *cplugin.InitContext) (*Core, error) {
	v, err := ic.GetByID(CorePlugin, ID)
	if err != nil {
		return nil, err
	}
	return v.(*Core), nil
}

// IsTidepool reports whether a registration is one of Tidepool's, so a host that links
// other plugins can initialise just these.
func IsTidepool(r *cplugin.Registration) bool {
	return r.ID == ID && (r.Type == CorePlugin || r.Type == PoolPlugin || r.Type == plugins.SnapshotPlugin || r.Type == plugins.GRPCPlugin)
}

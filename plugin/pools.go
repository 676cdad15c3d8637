package plugin

import (
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/pool"
)

// newPoolController builds the controller from the configuration; it starts
// connecting to containerd at once and keeps retrying until it answers. When the
// views are kernel views (views.mode kernel, or auto on a kernel that serves them),
// members get a slot and claims mount kernel views onto it (pool.Config.KernelViews).
func newPoolController(c *Core) (*pool.Controller, error) {
	cfg := poolConfig(c.Config)
	cfg.KernelViews = c.Views.Kernel() != nil
	return pool.NewController(cfg, c.Snapshotter)
}

// poolConfig maps the [pools] section onto the controller's configuration.
func poolConfig(c *Config) pool.Config {
	pc := c.Pools
	holder := pc.Holder
	if holder == "" {
		if self, err := os.Executable(); err == nil {
			holder = filepath.Join(filepath.Dir(self), "tidepool-holder")
		}
	}
	namespaces := pc.Namespaces
	if pc.Namespace != "" {
		// The old key keeps working: members stay where an existing set-up expects them.
		namespaces = []string{pc.Namespace}
		log.L.WithField("component", "pools").Warnf("config: pools.namespace is deprecated and overrides pools.namespaces; write pools.namespaces = [%q] instead", pc.Namespace)
	}
	cfg := pool.Config{
		ContainerdAddress: c.ContainerdAddress,
		Namespaces:        namespaces,
		StateDir:          filepath.Join(c.Root, "pools"),
		Holder:            holder,
		ShimConfig:        pc.ShimConfig,
		Snapshotter:       ID,
	}
	for _, t := range pc.Templates {
		cfg.Templates = append(cfg.Templates, pool.Template{
			Name: t.Name, Image: t.Image, Namespaces: t.Namespaces, Runtime: t.Runtime, Workdir: t.Workdir, Owner: t.Owner,
			CPUs: t.CPUs, Memory: t.MemoryMB << 20, Min: t.Min, Target: t.Target, Max: t.Max,
			RefillRate: t.RefillRate, MaxAge: time.Duration(t.MaxAge),
			ShimGroupSize: t.ShimGroupSize, ShimGroupGrace: time.Duration(t.ShimGroupGrace),
		})
	}
	return cfg
}

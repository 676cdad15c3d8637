package plugin

import (
	"os"
	"path/filepath"
	"time"

	"github.com/tidepool-dev/tidepool/pool"
)

// newPoolController builds the controller from the configuration; it starts
// connecting to containerd at once and keeps retrying until it answers.
func newPoolController(c *Core) (*pool.Controller, error) {
	pc := c.Config.Pools
	holder := pc.Holder
	if holder == "" {
		if self, err := os.Executable(); err == nil {
			holder = filepath.Join(filepath.Dir(self), "tidepool-holder")
		}
	}
	cfg := pool.Config{
		ContainerdAddress: c.Config.ContainerdAddress,
		Namespace:         pc.Namespace,
		StateDir:          filepath.Join(c.Config.Root, "pools"),
		Holder:            holder,
		ShimConfig:        pc.ShimConfig,
		Snapshotter:       ID,
	}
	for _, t := range pc.Templates {
		cfg.Templates = append(cfg.Templates, pool.Template{
			Name: t.Name, Image: t.Image, Runtime: t.Runtime, Workdir: t.Workdir, Owner: t.Owner,
			CPUs: t.CPUs, Memory: t.MemoryMB << 20, Min: t.Min, Target: t.Target, Max: t.Max,
			RefillRate: t.RefillRate, MaxAge: time.Duration(t.MaxAge),
			ShimGroupSize: t.ShimGroupSize, ShimGroupGrace: time.Duration(t.ShimGroupGrace),
		})
	}
	return pool.NewController(cfg, c.Snapshotter)
}

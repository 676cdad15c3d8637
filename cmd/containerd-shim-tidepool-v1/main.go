// Command containerd-shim-tidepool-v1 is the tidepool runtime shim (runtime type
// io.containerd.tidepool.v1): containerd's runc shim with per-container runtime routing
// and source-fork binding from OCI annotations. See package shim.
package main

import (
	"context"

	"github.com/containerd/containerd/v2/pkg/shim"

	tpshim "github.com/tidepool-dev/tidepool/shim"
)

func main() {
	tpshim.RegisterTaskPlugin()
	shim.RunShim(context.Background(), tpshim.NewManager(), tpshim.WithConcurrentReaper)
}

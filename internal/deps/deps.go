//go:build tools

// Package deps pins the module's dependencies before the code that uses them lands.
package deps

import (
	_ "github.com/containerd/containerd/v2/client"
	_ "github.com/containerd/containerd/v2/contrib/snapshotservice"
	_ "github.com/containerd/containerd/v2/core/snapshots/testsuite"
	_ "github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	_ "github.com/containerd/containerd/v2/pkg/shim"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	_ "github.com/containerd/continuity/fs"
	_ "github.com/containerd/errdefs"
	_ "github.com/containerd/log"
	_ "github.com/containerd/plugin"
	_ "github.com/coreos/go-systemd/v22/daemon"
	_ "github.com/hanwen/go-fuse/v2/fs"
	_ "github.com/opencontainers/runtime-spec/specs-go"
	_ "github.com/pelletier/go-toml/v2"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/schollz/progressbar/v3"
	_ "github.com/spf13/cobra"
	_ "go.etcd.io/bbolt"
	_ "google.golang.org/grpc"
	_ "k8s.io/cri-api/pkg/apis/runtime/v1"
	_ "lukechampine.com/blake3"
)

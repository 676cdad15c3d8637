package main

import (
	"fmt"
	"strings"
)

// Where `tidepool install` puts things, as paths on the host (under --host-root).
const (
	installBinDir       = "/usr/local/bin"
	installConfDir      = "/etc/tidepool"
	installDaemonConfig = "/etc/tidepool/tidepoold.toml"
	installUnit         = "/etc/systemd/system/tidepoold.service"
	installDropIn       = "/etc/containerd/conf.d/tidepool.toml"
	containerdConfig    = "/etc/containerd/config.toml"
	installManifest     = "/etc/tidepool/install.json"
	installBackups      = "/etc/tidepool/install-backup"
	// The defaults tidepoold's config names (tidepoold --print-default-config).
	defaultSnapAddress = "/run/tidepool/snapshotter.sock"
	defaultAPIAddress  = "/run/tidepool/api.sock"
)

// installBinaries are copied from the directory of the running tidepool (or
// --from) into installBinDir.
var installBinaries = []string{"tidepool", "tidepool-cli", "tidepoold", "containerd-shim-tidepool-v1", "tidepool-holder"}

// unitWants are the links `systemctl enable tidepoold` would make (the unit's
// [Install] WantedBy); install makes them itself, so it needs no running systemd
// (a node's root seen from a pod) and uninstall knows exactly what to remove.
var unitWants = []string{
	"/etc/systemd/system/multi-user.target.wants/tidepoold.service",
	"/etc/systemd/system/containerd.service.wants/tidepoold.service",
}

// tidepooldUnit is contrib/systemd/tidepoold.service (a test keeps them equal).
const tidepooldUnit = `# tidepoold: the Tidepool snapshotter (containerd proxy plugin), fork views and local API.
[Unit]
Description=Tidepool snapshotter and fork views for containerd
Documentation=https://github.com/tidepool-dev/tidepool
After=local-fs.target
# containerd needs the snapshotter socket at start, but a tidepoold failure must not
# take containerd down with it: Before= orders, WantedBy (not RequiredBy) attaches.
Before=containerd.service

[Service]
# READY=1 comes once containerd reaches the snapshotter socket again (after a crash its
# connection may be in reconnect backoff for up to 3 s): a restart returns when
# containerd can use tidepoold.
Type=notify
ExecStartPre=-/sbin/modprobe fuse
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/tidepoold --config /etc/tidepool/tidepoold.toml
# Only the main process gets the stop signal: anything that serves FUSE mounts in its
# own process keeps running containers' source views alive across a restart.
KillMode=process
Restart=always
RestartSec=1
# Views are served from this process; do not let the OOM killer pick it first.
OOMScoreAdjust=-999
LimitNOFILE=1048576
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target containerd.service
`

// dropIn is the containerd config drop-in: the proxy snapshotter, the transfer
// service's unpack entries, prompt garbage collection, and the CRI runtime handler
// with its image platform. version is the main config's (3 or 4: the keys are the
// same in both), so containerd need not migrate it; platform is this host's.
func dropIn(version int, platform string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `# Written by tidepool install; removed by tidepool uninstall. Do not edit: put your
# own settings in config.toml or another drop-in (this one is rewritten on install).
version = %d

# tidepoold serves the snapshotter "tidepool" (contrib/containerd/config.toml).
[proxy_plugins.tidepool]
  type = 'snapshot'
  address = '%s'
  platform = '%s'
  capabilities = ['rebase']
  [proxy_plugins.tidepool.exports]
    root = '/var/lib/tidepool'

# The transfer service (ctr images pull/import, nerdctl) unpacks only for snapshotters
# listed here; the overlayfs entry keeps containerd's default working.
[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
  platform = '%[3]s'
  snapshotter = 'overlayfs'
[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
  platform = '%[3]s'
  snapshotter = 'tidepool'

# A removed container's snapshot (and so its fork's commit) is collected at once.
[plugins.'io.containerd.gc.v1.scheduler']
  deletion_threshold = 1

# CRI: RuntimeClass handler "tidepool" (contrib/containerd/cri-runtime.toml).
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.tidepool]
  runtime_type = 'io.containerd.tidepool.v1'
  snapshotter = 'tidepool'
  pod_annotations = ['dev.tidepool.*']
  container_annotations = ['dev.tidepool.*']
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.tidepool.options]
    api_address = '%[4]s'

[plugins.'io.containerd.cri.v1.images'.runtime_platforms.tidepool]
  snapshotter = 'tidepool'
`, version, defaultSnapAddress, platform, defaultAPIAddress)
	return b.String()
}

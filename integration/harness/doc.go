// Package harness runs the real stack for integration tests: a private
// containerd per test (StartContainerd), any other daemon a test needs
// (StartDaemon, e.g. tidepoold), image import, and leak checks. Everything an
// instance creates lives under one short directory (/tmp/tph-NNN) or is named
// after it, so two test packages running at once never share state, and the
// cleanup registered with t.Cleanup removes all of it even when the test fails.
//
// What containerd 2.4.2 shares between instances unless told otherwise, and
// what the harness does about it (read from the v2.4.2 sources):
//
//   - Sockets. The gRPC and ttrpc sockets are set in config.toml
//     (plugins."io.containerd.server.v1.grpc".address and ".ttrpc".address).
//     Shim sockets go to the shim manager's socket_dir, default
//     /run/containerd/s for root (core/runtime/v2/shim_unix.go
//     defaultSocketDir); containerd hands it to shims as BootstrapParams
//     socket_dir and refuses one longer than 42 bytes, since a socket name of 64
//     hex digits is appended. The harness sets socket_dir = <dir>/s. The socket
//     name is sha256(<grpc address>/<namespace>/<group or id>), so it would
//     not collide anyway; the dir keeps /run/containerd clean.
//   - runc state. The runc shim runs runc with --root <Root>/<namespace>, where
//     Root comes from the runc options and defaults to /run/containerd/runc
//     (cmd/containerd-shim-runc-v2/process/init.go NewRunc). ctr and the Go
//     client send no Root, so the harness gives every instance its own
//     namespace (Containerd.Namespace, the directory's base name). CRI always
//     uses the k8s.io namespace, so the generated CRI runtimes set
//     options.Root = <dir>/runc. Bundles record the Root in options.json.
//   - cgroups. ctr and the client put a container in /<namespace>/<id>
//     (oci.WithDefaultSpec); on this cgroup v1 host runc creates that path in
//     every hierarchy (cpu, memory, freezer, pids, ..., name=systemd, and the
//     cgroup2 "unified" one). runc delete removes /<ns>/<id> but never /<ns>;
//     the cleanup removes both. CRI cgroups come from the pod's cgroup_parent:
//     register them with TrackCgroup.
//   - FIFOs. ctr and the Go client create task FIFOs in /run/containerd/fifo
//     unless given --fifo-dir / cio.WithFIFODir: use Containerd.FIFODir.
//   - Config. A config file's own `imports` are the only ones loaded, so the
//     generated config (version 4) sets imports = [] and never reads
//     /etc/containerd. NRI is disabled (its socket is host-wide); CRI, when
//     enabled, keeps pod netns under the state dir
//     (netns_mounts_under_state_dir), sets restrict_oom_score_adj = true (root
//     here lacks CAP_SYS_RESOURCE) and pins a local sandbox image
//     (plugins."io.containerd.cri.v1.images".pinned_images.sandbox).
//   - PATH. containerd resolves runtime io.containerd.<name>.<v> to the binary
//     containerd-shim-<name>-<v> on PATH; the harness puts $TIDEPOOL_BIN, then
//     the pinned tools ($TIDEPOOL_DEPS_BIN), first. Shims inherit containerd's
//     environment, so the runc shim finds the pinned runc.
//
// Leak-proofing: containerd is started in its own process group with
// PR_SET_PDEATHSIG, so it dies with the test binary. Each instance holds an
// flock on <dir>/.lock and records itself in <dir>/instance.json; the first
// StartContainerd of a test binary cleans up any instance whose lock is free
// (its test binary died before its cleanups ran: a timeout panic, a SIGKILL).
package harness

// Package shim is containerd-shim-tidepool-v1 (runtime type io.containerd.tidepool.v1):
// a containerd runtime v2 shim that picks the OCI runtime per container from the
// dev.tidepool.runtime annotation and binds the container's source fork from the
// dev.tidepool.* annotations before its rootfs is mounted.
//
// Routes come from a routing table in the shim's TOML config. A "runc" route is served
// in this process by containerd's own runc task service (with its BinaryName, so runc,
// crun or runsc), wrapped to normalise the runtime options CRI sends and to bind the
// fork through tidepoold's local API. A "shim" route hands the container to another
// shim binary at start (Kata Containers with Firecracker, say): that shim's address is
// returned to containerd, which then talks to it directly, and delete is forwarded.
//
// The shim is built on pkg/shim RunShim and the bootstrap protocol, so it needs
// containerd 2.3 or newer.
package shim

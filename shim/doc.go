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
// Containers annotated with dev.tidepool.shim-group (warm pool members) share one shim
// process per group, as containerd's runc shim shares one per pod; unlike runc's, a
// group's shim outlives its last container by a grace period and never leaves while a
// start that was handed its address is on its way (group.go).
//
// The shim is built on pkg/shim RunShim and the bootstrap protocol, so it needs
// containerd 2.3 or newer.
package shim

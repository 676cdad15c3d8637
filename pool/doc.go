// Package pool keeps warm pools of pre-created, frozen containers so that a workload
// with its source fork starts in milliseconds. A member is a real containerd container
// (labelled with its pool, visible with ctr) whose rootfs is a tidepool snapshot
// prepared for a fork known only at claim, whose task runs through the tidepool shim
// with tidepool-holder as pid 1, and which is frozen once the holder is ready.
//
// How the fork gets into a running, frozen member depends on the views. With kernel
// views (Config.KernelViews) a member on the runc route binds its snapshot's slot at
// the workdir with rslave propagation (binding.LabelSlot; the snapshotter's slot.go),
// and the claim mounts the fork's kernel view, writable, onto the slot on the host:
// the mount propagates into the member. Otherwise (views.mode fuse, runsc) the
// member's rootfs has an empty FUSE view that the claim binds. The slot was chosen
// over keeping FUSE for members because agents read their source all day: in a
// claimed member a warm full read of the Go tree took 1.17x the tree baked into the
// image against 3.62x through FUSE, a warm `grep -r` 1.05x against 1.54x, for a
// claim ~5-8 ms slower when the tree's image exists (cached, or built behind the
// fork's previous claim: prebuild) and ~0.15 s slower when it must be built
// (BenchmarkPoolViews; the README has the table). Mounting into the member's
// namespace at claim (setns) was the other way: it needs no spec change, but a FUSE
// view could not follow it there, and commit and removal would have nothing on the
// host to read or unmount.
//
// A claim binds the requested fork to the member's view (or slot), hands the holder the
// workload (argv, environment, working directory and stdio descriptors) over its
// control socket, and thaws the task: the holder execs the workload, which becomes the
// task's init process. When it exits, its changes are committed to the fork and the
// member is destroyed; a used member never returns to a pool, and the controller
// refills the pool at its refill rate, recycles members older than their maximum age,
// and reconciles its members with containerd after a restart.
//
// A container that adopts a member transparently (through the shim) keeps what it
// asked for: eligibility compares every field of its OCI spec that runc fixes at
// create with the member's (specRules, which a test keeps complete), and what can be
// applied late is: the holder takes argv, environment and working directory, and the
// member's processes move into a cgroup made at the container's own path with its
// resources. Anything else starts the container cold, with a counted reason.
//
// Members live in the containerd namespaces their pool serves (Template.Namespaces,
// by default "default", where ctr and nerdctl create containers; CRI uses "k8s.io"),
// one member set per (pool, namespace), each kept at the template's sizes. A
// container adopts only a member of its own namespace, which it is told by its
// snapshot's key ("<namespace>/<id>/<name>" in the snapshotter). The reason is the
// snapshot chain: containerd unpacks an image once per namespace, so the same image
// has different parent snapshots in two namespaces, and a member's snapshot can be
// re-keyed to a container's only if both have the same parent. Re-parenting a
// member's snapshot onto another namespace's chain was the alternative; it was not
// taken, because containerd's metadata would then name, in the container's namespace,
// a parent other than the one the snapshotter holds the snapshot under (the other
// namespace's), and its garbage collector, which walks each namespace's chain and
// removes what no namespace references, would act on parents inconsistent with the
// snapshotter's. Members are thus visible in the namespaces people use
// (`ctr c ls`), so they are named "tidepool-POOL-..." and labelled (LabelPool,
// LabelMember, LabelState); a container counts as a member only if its member label
// names it, so a user's container is never mistaken for one. Explicit claims (Run)
// take a member of any namespace the pool serves.
//
// Claims come first (priority.go): the refill a claim triggers, and the teardown of
// used members, wait until claims have been quiet for a moment, so a burst of claims
// does not share the host with the background work it caused.
//
// Whoever can bind a member's control socket receives the workload, secrets and stdio
// included; so the control directories are reachable by root and the holder's user
// only, and the sender checks the listener's SO_PEERCRED (the member's holder pid, in
// its cgroup) before it sends anything. The package reaches containerd through its
// client and the snapshotter through the Snapshots interface, so its decisions are
// unit-tested over fakes, without root.
package pool

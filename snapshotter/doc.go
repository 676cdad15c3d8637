// Package snapshotter is the tidepool containerd snapshotter: containerd's own overlay
// snapshotter for the image layers, with a read-only view of a source fork placed on
// top of them as the highest lower layer (a kernel view's EROFS image itself, with the
// object store as data-only layer, where the options allow: see LayeringDirect). The container's rootfs is then
// baked dependencies (image) united with forked source (view), and its writes land in
// the overlay upper directory. Removing a fork-bearing snapshot commits what changed
// under the workdir back to the fork as a new root, in O(changed).
//
// Layer management is delegated, not re-implemented: every snapshot lives in the
// overlay snapshotter's metastore and directories, with short integer ids, and passes
// containerd's snapshotter test suite as the overlay snapshotter does. This package
// adds the fork binding (labels, or Bind for the runtime shim), the view lifecycle and
// the commit on remove. Views are mounted through the ViewHost interface, so the code
// that serves them can move into a process that outlives this one.
//
// A snapshot prepared with a slot (binding.LabelSlot: warm pool members with kernel
// views) has no view in its rootfs; Bind mounts the fork's view with a writable
// overlay onto a shared host directory that the container binds at its workdir, and
// its commit walks that overlay's upper directory (slot.go).
package snapshotter

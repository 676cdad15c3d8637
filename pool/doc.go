// Package pool keeps warm pools of pre-created, frozen containers so that a workload
// with its source fork starts in milliseconds. A member is a real containerd container
// (labelled with its pool, visible with ctr) whose rootfs is a tidepool snapshot with
// an empty, late-bound fork view, whose task runs through the tidepool shim with
// tidepool-holder as pid 1, and which is frozen once the holder is ready.
//
// A claim binds the requested fork to the member's view, hands the holder the
// workload (argv, environment, working directory and stdio descriptors) over its
// control socket, and thaws the task: the holder execs the workload, which becomes the
// task's init process. When it exits, its changes are committed to the fork and the
// member is destroyed; a used member never returns to a pool, and the controller
// refills the pool at its refill rate, recycles members older than their maximum age,
// and reconciles its members with containerd after a restart.
package pool

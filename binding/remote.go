package binding

import "strings"

// RemoteForkPrefix marks a fork value (label or annotation) that names a ref in the
// configured remote instead of a local fork: "remote:main" starts the container on a
// new local fork of the ref's current root, hydrated from the bucket, and pushes the
// fork's commit back to the ref by compare-and-swap when the container is removed.
const RemoteForkPrefix = "remote:"

// Fork record labels that tie a local fork to a remote ref, set by `tidepool pull
// --fork` and by the snapshotter for remote: forks.
const (
	// ForkLabelRemoteRef is the ref the fork was made from and is pushed back to.
	ForkLabelRemoteRef = "tidepool.remote.ref"
	// ForkLabelRemoteRoot is the ref's root when the fork was made: the expected value
	// of the compare-and-swap that pushes the fork back.
	ForkLabelRemoteRoot = "tidepool.remote.root"
)

// RemoteRef splits a "remote:NAME" fork value; ok is false for any other value.
func RemoteRef(fork string) (name string, ok bool) {
	return strings.CutPrefix(fork, RemoteForkPrefix)
}

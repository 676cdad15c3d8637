// Package plugin registers Tidepool's components with github.com/containerd/plugin, so
// the same code runs in two hosts: tidepoold (a containerd proxy plugin, the default)
// and a containerd binary built with this package imported as a built-in. Both read
// the one Config.
//
// Registrations:
//   - dev.tidepool.core.v1 "tidepool": the store, fork database, view host and
//     snapshotter, assembled once from Config;
//   - io.containerd.snapshotter.v1 "tidepool": the snapshotter;
//   - io.containerd.grpc.v1 "tidepool": the local API (forks, bind) as gRPC services.
package plugin

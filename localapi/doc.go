// Package localapi serves and consumes tidepoold's local gRPC API (api/v1): fork
// records for clients that cannot open the fork database while the daemon holds it,
// fork binding for the runtime shim, snapshot listings and daemon facts. The Client
// implements forks.Service, so the CLI is the same code whether it talks to the
// database or to the daemon.
package localapi

// Command tidepoold is the Tidepool daemon: it serves the tidepool snapshotter to
// containerd as a proxy plugin over gRPC, serves fork views through FUSE, answers the
// local API used by the tidepool CLI and the runtime shim, and exports Prometheus
// metrics. Its components are the same plugins a containerd built with Tidepool as a
// built-in would load.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/plugin"
)

// DefaultConfigPath is read when --config is not given; it may be absent.
const DefaultConfigPath = "/etc/tidepool/tidepoold.toml"

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "tidepoold: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("tidepoold", flag.ContinueOnError)
	var (
		configPath   = fs.String("config", "", "TOML config file (default "+DefaultConfigPath+" if it exists)")
		root         = fs.String("root", "", "state directory (overrides root)")
		address      = fs.String("address", "", "snapshotter gRPC socket (overrides address)")
		apiAddress   = fs.String("api-address", "", "local API socket (overrides api_address)")
		metricsAddr  = fs.String("metrics-address", "", "Prometheus metrics address, \"none\" to disable (overrides metrics_address)")
		ctrdAddr     = fs.String("containerd-address", "", "containerd socket, \"none\" to disable (overrides containerd_address)")
		logLevel     = fs.String("log-level", "info", "log level (debug, info, warn, error)")
		printDefault = fs.Bool("print-default-config", false, "print the default configuration and exit")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *printDefault {
		b, err := defaultConfigTOML()
		if err != nil {
			return err
		}
		_, err = os.Stdout.Write(b)
		return err
	}
	if err := log.SetLevel(*logLevel); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	path, must := *configPath, true
	if path == "" {
		path, must = DefaultConfigPath, false
	}
	cfg, err := plugin.LoadConfig(path, must)
	if err != nil {
		return err
	}
	for flagValue, field := range map[*string]*string{root: &cfg.Root, address: &cfg.Address, apiAddress: &cfg.APIAddress,
		metricsAddr: &cfg.MetricsAddress, ctrdAddr: &cfg.ContainerdAddress} {
		if *flagValue != "" {
			*field = *flagValue
		}
		if *field == "none" {
			*field = ""
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return serve(ctx, cfg)
}

// defaultConfigTOML is what --print-default-config prints: every key with its
// default and its comment. contrib/tidepoold.toml is exactly this output; a golden
// test keeps them equal (go test ./cmd/tidepoold -run Golden -update rewrites it).
func defaultConfigTOML() ([]byte, error) {
	b, err := plugin.DefaultConfig().Marshal()
	if err != nil {
		return nil, err
	}
	header := "# tidepoold configuration: every key with its default (`tidepoold --print-default-config`).\n" +
		"# Install as /etc/tidepool/tidepoold.toml; command-line flags override it.\n\n"
	return append([]byte(header), b...), nil
}

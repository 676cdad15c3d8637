package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/log"
	cplugin "github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/tidepool-dev/tidepool/internal/arrivalspool"
	"github.com/tidepool-dev/tidepool/internal/peercred"
	"github.com/tidepool-dev/tidepool/localapi/apiserver"
	"github.com/tidepool-dev/tidepool/localapi/runwire"
	"github.com/tidepool-dev/tidepool/plugin"
	"github.com/tidepool-dev/tidepool/pool"
	"github.com/tidepool-dev/tidepool/snapshotgc"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// shutdownGrace bounds how long in-flight RPCs (a commit on Remove, say) may run after
// a stop signal before they are cut off.
const shutdownGrace = 30 * time.Second

// components are the plugin instances tidepoold serves.
type components struct {
	core        *plugin.Core
	snapshotter snapshots.Snapshotter
	api         *apiserver.Server
	pools       *pool.Controller
}

// loadPlugins initialises Tidepool's registrations in dependency order, exactly as
// containerd would for built-ins, with cfg as the core's configuration.
func loadPlugins(ctx context.Context, cfg *plugin.Config) (*components, error) {
	set := cplugin.NewPluginSet()
	var c components
	for _, reg := range registry.Graph(func(r *cplugin.Registration) bool { return !plugin.IsTidepool(r) }) {
		ic := cplugin.NewContext(ctx, set, map[string]string{plugin.PropertyDeferPools: "1"})
		ic.Config = cfg
		p := reg.Init(ic)
		if err := set.Add(p); err != nil {
			return &c, fmt.Errorf("add plugin %s: %w", reg.URI(), err)
		}
		inst, err := p.Instance()
		if err != nil {
			return &c, fmt.Errorf("init plugin %s: %w", reg.URI(), err)
		}
		switch v := inst.(type) {
		case *plugin.Core:
			c.core = v
		case snapshots.Snapshotter:
			c.snapshotter = v
		case *apiserver.Server:
			c.api = v
		case *pool.Controller:
			c.pools = v
		}
	}
	if c.core == nil || c.snapshotter == nil || c.api == nil || c.pools == nil {
		return &c, errors.New("tidepool plugins are not all registered")
	}
	return &c, nil
}

func serve(ctx context.Context, cfg *plugin.Config) (retErr error) {
	if err := cfg.Validate(); err != nil {
		return err
	}
	c, err := loadPlugins(ctx, cfg)
	if c != nil && c.core != nil {
		defer func() {
			if c.pools != nil {
				c.pools.Stop()
			}
			if err := c.core.Close(); err != nil && retErr == nil {
				retErr = err
			}
		}()
	}
	if err != nil {
		return err
	}

	reg := prometheus.NewRegistry()
	rpc := newRPCMetrics()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), rpc)
	reg.MustRegister(c.core.Collectors()...)
	reg.MustRegister(c.pools.Metrics())

	snapSrv := grpc.NewServer(grpc.ChainUnaryInterceptor(rpc.unary("snapshots")))
	snapshotsapi.RegisterSnapshotsServer(snapSrv, snapshotservice.FromSnapshotter(c.snapshotter))
	apiSrv := grpc.NewServer(grpc.ChainUnaryInterceptor(rpc.unary("api")))
	if err := c.api.Register(apiSrv); err != nil {
		return err
	}

	errc := make(chan error, 4)
	for _, s := range []struct {
		srv  *grpc.Server
		addr string
	}{{snapSrv, cfg.Address}, {apiSrv, cfg.APIAddress}} {
		l, err := listenUnix(s.addr)
		if err != nil {
			return err
		}
		defer os.Remove(s.addr)
		go func(srv *grpc.Server, l net.Listener) { errc <- srv.Serve(l) }(s.srv, l)
	}
	// The run socket: `tidepool run`'s fast path (package runwire), beside the API.
	runAddr := runwire.Address(cfg.APIAddress)
	runL, err := listenUnix(runAddr)
	if err != nil {
		return err
	}
	defer os.Remove(runAddr)
	runDone := make(chan struct{})
	go func() {
		defer close(runDone)
		if err := c.api.ServeRun(context.WithoutCancel(ctx), runL); err != nil {
			errc <- fmt.Errorf("run socket: %w", err)
		}
	}()
	var metricsSrv *http.Server
	if cfg.MetricsAddress != "" {
		l, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() { errc <- metricsSrv.Serve(l) }()
	}

	if cfg.ContainerdAddress != "" {
		gcCtx, stopGC := context.WithCancel(ctx)
		defer stopGC()
		go snapshotgc.Run(gcCtx, cfg.ContainerdAddress, plugin.ID)
	}

	stateFile := filepath.Join(cfg.Root, StateFileName)
	if err := writeState(stateFile, cfg, c.core.Views.Mode()); err != nil {
		return err
	}
	defer os.Remove(stateFile)
	// Only now that a command finds this daemon: a root recorded from here on is told
	// to it, and one recorded before is in the spool.
	prepareRecordedRoots(ctx, cfg, c.core.Snapshotter)
	waitForContainerd(ctx, cfg, c.snapshotter)
	// Only now: members are containers on this snapshotter (plugin.PropertyDeferPools).
	c.pools.Start(ctx)
	if _, err := daemon.SdNotify(false, daemon.SdNotifyReady); err != nil {
		log.G(ctx).WithError(err).Warn("systemd notify failed")
	}
	log.G(ctx).WithField("root", cfg.Root).WithField("address", cfg.Address).
		WithField("api_address", cfg.APIAddress).WithField("metrics_address", cfg.MetricsAddress).Info("tidepoold ready")

	select {
	case <-ctx.Done():
	case err := <-errc:
		retErr = fmt.Errorf("server stopped: %w", err)
	}
	daemon.SdNotify(false, daemon.SdNotifyStopping)
	log.G(ctx).Info("tidepoold shutting down")
	stopped := make(chan struct{})
	go func() {
		snapSrv.GracefulStop()
		apiSrv.GracefulStop()
		close(stopped)
	}()
	runL.Close() // no new runs; those under way finish with their result
	select {
	case <-stopped:
	case <-time.After(shutdownGrace):
		snapSrv.Stop()
		apiSrv.Stop()
	}
	select {
	case <-runDone:
	case <-time.After(shutdownGrace):
		log.G(ctx).Warn("runs still under way at shutdown")
	}
	if err := c.api.Close(); err != nil {
		log.G(ctx).WithError(err).Warn("close the API server's containerd connection")
	}
	if metricsSrv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		metricsSrv.Shutdown(sctx)
		cancel()
	}
	return retErr
}

// recordedRoots is how many of the roots recorded while no tidepoold ran (the newest)
// a starting daemon prepares views of.
const recordedRoots = 8

// prepareRecordedRoots takes the roots commands put in the store while no tidepoold
// ran (package arrivalspool) and has the snapshotter prepare their views in the
// background, as for roots it is told of while it runs.
func prepareRecordedRoots(ctx context.Context, cfg *plugin.Config, sn *snapshotter.Snapshotter) {
	roots, skipped, err := arrivalspool.Take(cfg.Root, cfg.StorePath(), recordedRoots)
	if err != nil {
		log.G(ctx).WithError(err).Warn("arrival spool not read in full")
	}
	if skipped > 0 {
		log.G(ctx).WithField("skipped", skipped).Info("dropped arrival records of other stores")
	}
	if len(roots) == 0 {
		return
	}
	log.G(ctx).WithField("roots", len(roots)).Info("preparing the views of roots put in the store while tidepoold was stopped")
	sn.RootsRecorded(roots)
}

// listenUnix listens on a unix socket, replacing a stale socket file but refusing to
// take over one a live process still answers on.
func listenUnix(addr string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(addr), 0o700); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
	// Whoever can replace the socket receives what containerd, the shim and the CLI
	// send (container specs with their environment, workloads).
	if err := peercred.CheckDir(filepath.Dir(addr)); err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	if conn, err := net.DialTimeout("unix", addr, time.Second); err == nil {
		conn.Close()
		return nil, fmt.Errorf("%s is in use by another process (is tidepoold already running?)", addr)
	}
	if err := os.Remove(addr); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("remove stale socket %s: %w", addr, err)
	}
	l, err := net.Listen("unix", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	if err := os.Chmod(addr, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return peercred.Listener(l, func(err error) {
		log.L.WithError(err).WithField("address", addr).Warn("refused a connection")
	}), nil
}

// StateFileName is written into the root while the daemon runs, so the CLI can find
// the API socket of the daemon that owns a root.
const StateFileName = "tidepoold.json"

func writeState(path string, cfg *plugin.Config, viewMode string) error {
	b, err := json.Marshal(map[string]any{
		"pid": os.Getpid(), "address": cfg.Address, "api_address": cfg.APIAddress,
		"view_mode": viewMode,
	})
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return os.Rename(tmp, path)
}

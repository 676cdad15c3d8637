package main

import (
	"context"
	"errors"
	"net"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/internal/containerdreach"
	"github.com/tidepool-dev/tidepool/plugin"
)

// probeKeys is how many of its snapshots tidepoold may ask containerd about.
const probeKeys = 3

// waitForContainerd holds tidepoold's "ready" until containerd's connection to the
// snapshotter socket works again (package containerdreach): after a crash or a stop
// during which containerd called it, that connection waits out a backoff of up to
// 3 s, and containerd's calls fail meanwhile. It does not wait when containerd is not
// up (tidepoold starts first at boot) or knows of no tidepool snapshot.
func waitForContainerd(ctx context.Context, cfg *plugin.Config, sn snapshots.Snapshotter) {
	if cfg.ContainerdAddress == "" {
		return
	}
	l := log.G(ctx).WithField("containerd", cfg.ContainerdAddress)
	keys, err := snapshotKeys(ctx, sn, probeKeys)
	if errdefs.IsNotFound(err) {
		return // a new root: no snapshot yet
	}
	if err != nil {
		l.WithError(err).Warn("snapshots not listed; not waiting for containerd to reach tidepoold")
		return
	}
	if len(keys) == 0 {
		return
	}
	addr := strings.TrimPrefix(cfg.ContainerdAddress, "unix://")
	c, err := net.DialTimeout("unix", addr, time.Second)
	if err != nil {
		l.WithError(err).Debug("containerd not up; not waiting for it to reach tidepoold")
		return
	}
	c.Close()
	client, err := containerd.New(addr, containerd.WithTimeout(time.Second))
	if err != nil {
		l.WithError(err).Warn("not waiting for containerd to reach tidepoold")
		return
	}
	defer client.Close()
	start := time.Now()
	outcome, err := containerdreach.Wait(ctx, statProber{client.SnapshotService(plugin.ID)}, keys, containerdreach.DefaultOptions)
	waited := time.Since(start)
	l = l.WithField("outcome", outcome).WithField("waited", waited.Round(time.Millisecond))
	switch {
	case outcome == containerdreach.TimedOut:
		l.WithError(err).Warn("containerd still cannot reach the snapshotter; ready anyway")
	case outcome == containerdreach.Unknown:
		l.WithError(err).Info("could not tell whether containerd reaches the snapshotter; ready anyway")
	case waited > 100*time.Millisecond:
		l.Info("waited for containerd to reconnect to the snapshotter")
	default:
		l.Debug("containerd reaches the snapshotter")
	}
}

// snapshotKeys returns up to n of sn's snapshots as containerd names them, committed
// ones (image layers, which containerd keeps) first.
func snapshotKeys(ctx context.Context, sn snapshots.Snapshotter, n int) ([]containerdreach.Key, error) {
	var committed, other []containerdreach.Key
	enough := errors.New("enough")
	err := sn.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		k, ok := containerdreach.KeyOf(info.Name)
		switch {
		case !ok:
		case info.Kind == snapshots.KindCommitted:
			committed = append(committed, k)
		case len(other) < n:
			other = append(other, k)
		}
		if len(committed) >= n {
			return enough
		}
		return nil
	})
	if err != nil && !errors.Is(err, enough) {
		return nil, err
	}
	keys := append(committed, other...)
	return keys[:min(n, len(keys))], nil
}

// statProber asks containerd's snapshot service (which asks tidepoold) about a key.
type statProber struct{ sn snapshots.Snapshotter }

func (p statProber) Stat(ctx context.Context, k containerdreach.Key) error {
	_, err := p.sn.Stat(namespaces.WithNamespace(ctx, k.Namespace), k.Name)
	return err
}

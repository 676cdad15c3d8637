package localapi

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/internal/peercred"
)

// Client talks to tidepoold's local API over a unix socket.
type Client struct {
	address   string
	conn      *grpc.ClientConn
	forks     apiv1.ForksClient
	snapshots apiv1.SnapshotsClient
	daemon    apiv1.DaemonClient
}

var _ forks.Service = (*Client)(nil)

// Dial connects to the API socket at address and checks that a daemon answers within
// timeout, so callers can fall back cleanly when none runs.
func Dial(ctx context.Context, address string, timeout time.Duration) (*Client, error) {
	c, err := Connect(address)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := c.daemon.Info(pctx, &apiv1.InfoRequest{}, grpc.WaitForReady(true)); err != nil {
		c.conn.Close()
		return nil, fmt.Errorf("tidepoold API at %s does not answer: %w", address, errgrpc.ToNative(err))
	}
	return c, nil
}

// Connect makes a client of the API socket at address without a round trip: the
// connection is made by the first call, which fails at once (no retries) when no
// daemon listens. Callers with nothing to fall back to use it, to keep the round trip
// off their path.
func Connect(address string) (*Client, error) {
	// The daemon must be root (or us): a socket someone else bound would receive
	// container specs and workloads.
	dial := func(ctx context.Context, _ string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", address)
		if err != nil {
			return nil, err
		}
		if err := peercred.CheckConn(c); err != nil {
			c.Close()
			return nil, fmt.Errorf("tidepoold API at %s: %w", address, err)
		}
		return c, nil
	}
	conn, err := grpc.NewClient("passthrough:///"+address, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(dial))
	if err != nil {
		return nil, fmt.Errorf("tidepoold API at %s: %w", address, err)
	}
	return &Client{address: address, conn: conn, forks: apiv1.NewForksClient(conn), snapshots: apiv1.NewSnapshotsClient(conn), daemon: apiv1.NewDaemonClient(conn)}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Info asks the daemon about itself.
func (c *Client) Info(ctx context.Context) (*apiv1.InfoResponse, error) {
	r, err := c.daemon.Info(ctx, &apiv1.InfoRequest{})
	return r, errgrpc.ToNative(err)
}

// RootArrived tells the daemon of a root this client put in the store, so that it
// prepares the root's views.
func (c *Client) RootArrived(ctx context.Context, root casstore.Hash) error {
	_, err := c.daemon.RootArrived(ctx, &apiv1.RootArrivedRequest{Root: root.String()})
	return errgrpc.ToNative(err)
}

func (c *Client) fork(p *apiv1.Fork, err error) (*forks.Fork, error) {
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	return ForkFromProto(p)
}

// Create implements forks.Service.
func (c *Client) Create(ctx context.Context, req forks.CreateRequest) (*forks.Fork, error) {
	labels := req.Labels
	if req.RequestID != "" {
		// The request id travels as the fork label that records it (forks.RequestIDLabel),
		// so the daemon's database dedups a retried create.
		labels = make(map[string]string, len(req.Labels)+1)
		for k, v := range req.Labels {
			labels[k] = v
		}
		if l, ok := labels[forks.RequestIDLabel]; ok && l != req.RequestID {
			return nil, fmt.Errorf("request id %q and label %s=%q disagree: %w", req.RequestID, forks.RequestIDLabel, l, errdefs.ErrInvalidArgument)
		}
		labels[forks.RequestIDLabel] = req.RequestID
	}
	r := &apiv1.CreateForkRequest{Base: req.Base.String(), Label: req.Label, Labels: labels}
	if req.TTL != 0 {
		r.Ttl = durationpb.New(req.TTL)
	}
	return c.fork(c.forks.Create(ctx, r))
}

// Get implements forks.Service.
func (c *Client) Get(ctx context.Context, ref string) (*forks.Fork, error) {
	return c.fork(c.forks.Get(ctx, &apiv1.GetForkRequest{Ref: ref}))
}

// List implements forks.Service.
func (c *Client) List(ctx context.Context) ([]*forks.Fork, error) {
	r, err := c.forks.List(ctx, &apiv1.ListForksRequest{})
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	out := make([]*forks.Fork, 0, len(r.GetForks()))
	for _, p := range r.GetForks() {
		f, err := ForkFromProto(p)
		if err != nil {
			return nil, err
		}
		out = append(out, f)
	}
	return out, nil
}

// Remove implements forks.Service.
func (c *Client) Remove(ctx context.Context, id string) error {
	_, err := c.forks.Remove(ctx, &apiv1.RemoveForkRequest{Id: id})
	return errgrpc.ToNative(err)
}

// Advance implements forks.Service.
func (c *Client) Advance(ctx context.Context, id string, expect, newRoot casstore.Hash, reason string) (*forks.Fork, error) {
	r := &apiv1.AdvanceForkRequest{Id: id, Root: newRoot.String(), Reason: reason}
	if !expect.IsZero() {
		r.Expect = expect.String()
	}
	return c.fork(c.forks.Advance(ctx, r))
}

// LiveRoots lists every root garbage collection must keep.
func (c *Client) LiveRoots(ctx context.Context) ([]casstore.Hash, error) {
	r, err := c.forks.LiveRoots(ctx, &apiv1.LiveRootsRequest{})
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	out := make([]casstore.Hash, 0, len(r.GetRoots()))
	for _, s := range r.GetRoots() {
		h, err := ParseHash("live root", s)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, nil
}

// Bind asks the daemon to bind a fork to a snapshot.
func (c *Client) Bind(ctx context.Context, req *apiv1.BindRequest) (*apiv1.BindResponse, error) {
	r, err := c.snapshots.Bind(ctx, req)
	return r, errgrpc.ToNative(err)
}

// ListSnapshots lists the daemon's snapshots and their forks.
func (c *Client) ListSnapshots(ctx context.Context) ([]*apiv1.Snapshot, error) {
	r, err := c.snapshots.List(ctx, &apiv1.ListSnapshotsRequest{})
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	return r.GetSnapshots(), nil
}

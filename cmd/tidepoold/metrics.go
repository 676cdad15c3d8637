package main

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// rpcMetrics measures every unary RPC of both servers in one interceptor, so no
// method carries metric code of its own.
type rpcMetrics struct {
	seconds *prometheus.HistogramVec
}

func newRPCMetrics() *rpcMetrics {
	return &rpcMetrics{seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "tidepool", Subsystem: "rpc", Name: "duration_seconds",
		Help:    "Latency of gRPC calls served by tidepoold, by server, method and status code.",
		Buckets: prometheus.ExponentialBuckets(0.0001, 2.5, 16),
	}, []string{"server", "method", "code"})}
}

func (m *rpcMetrics) Describe(ch chan<- *prometheus.Desc) { m.seconds.Describe(ch) }
func (m *rpcMetrics) Collect(ch chan<- prometheus.Metric) { m.seconds.Collect(ch) }

func (m *rpcMetrics) unary(server string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		m.seconds.WithLabelValues(server, info.FullMethod, status.Code(err).String()).Observe(time.Since(start).Seconds())
		return resp, err
	}
}

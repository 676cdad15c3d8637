package snapshotter

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the snapshotter's own Prometheus collectors; per-RPC latency and errors
// come from the daemon's gRPC interceptor instead.
type Metrics struct {
	commitSeconds prometheus.Histogram
	commitErrors  prometheus.Counter
	binds         *prometheus.CounterVec
}

func newMetrics() *Metrics {
	return &Metrics{
		commitSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "fork_commit_seconds",
			Help:    "Time to commit a removed snapshot's changes to its fork.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		commitErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "fork_commit_errors_total",
			Help: "Commits to a fork that failed (the snapshot was kept).",
		}),
		binds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "fork_binds_total",
			Help: "Forks bound to snapshots, by entrance (label, api, late).",
		}, []string{"entrance"}),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.commitSeconds.Describe(ch)
	m.commitErrors.Describe(ch)
	m.binds.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.commitSeconds.Collect(ch)
	m.commitErrors.Collect(ch)
	m.binds.Collect(ch)
}

package snapshotter

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the snapshotter's own Prometheus collectors; per-RPC latency and errors
// come from the daemon's gRPC interceptor instead.
type Metrics struct {
	commitSeconds prometheus.Histogram
	commitErrors  prometheus.Counter
	binds         *prometheus.CounterVec
	// Branches of live snapshots: the whole call, and how long writers were frozen.
	branchSeconds       prometheus.Histogram
	branchPausedSeconds prometheus.Histogram
	// Views of arriving roots (arrival.go): roots by how they were told, views
	// queued or being prepared, views prepared.
	rootsArrived  *prometheus.CounterVec
	viewsPending  prometheus.Gauge
	viewsPrepared prometheus.Counter
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
		branchSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "branch_seconds",
			Help:    "Time to branch a live snapshot's changes into new forks.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		branchPausedSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "branch_paused_seconds",
			Help:    "How long a branched snapshot's writers (its container) were frozen.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		rootsArrived: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "roots_arrived_total",
			Help: "Roots whose views are prepared in the background, by how they were told: commit (a container's), api (a fork made or moved, a command's root), spool (a command's root recorded while no tidepoold ran).",
		}, []string{"via"}),
		viewsPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "views_preparing",
			Help: "Views of arrived roots queued or being prepared.",
		}),
		viewsPrepared: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "snapshotter", Name: "views_prepared_total",
			Help: "Views of arrived roots prepared (a kernel view's image built or found cached).",
		}),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.commitSeconds.Describe(ch)
	m.commitErrors.Describe(ch)
	m.binds.Describe(ch)
	m.branchSeconds.Describe(ch)
	m.branchPausedSeconds.Describe(ch)
	m.rootsArrived.Describe(ch)
	m.viewsPending.Describe(ch)
	m.viewsPrepared.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.commitSeconds.Collect(ch)
	m.commitErrors.Collect(ch)
	m.binds.Collect(ch)
	m.branchSeconds.Collect(ch)
	m.branchPausedSeconds.Collect(ch)
	m.rootsArrived.Collect(ch)
	m.viewsPending.Collect(ch)
	m.viewsPrepared.Collect(ch)
}

package pool

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the pools' Prometheus collectors.
type Metrics struct {
	members       *prometheus.GaugeVec
	claimSeconds  *prometheus.HistogramVec
	coldFallbacks *prometheus.CounterVec
	adoptions     *prometheus.CounterVec
	discarded     *prometheus.CounterVec
	ageAtClaim    *prometheus.HistogramVec
	oldestIdle    *prometheus.GaugeVec
}

func newMetrics() *Metrics {
	return &Metrics{
		members: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "members",
			Help: "Pool members by containerd namespace and state (idle, claimed, starting).",
		}, []string{"pool", "namespace", "state"}),
		claimSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "claim_seconds",
			Help:    "Time from a claim to its workload being started in a member.",
			Buckets: prometheus.ExponentialBuckets(0.001, 1.5, 20),
		}, []string{"pool"}),
		coldFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "cold_fallbacks_total",
			Help: "Containers that asked for a pool but were started cold, by reason.",
		}, []string{"pool", "reason"}),
		adoptions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "adoptions_total",
			Help: "Containers that asked for a pool and adopted a warm member, by containerd namespace.",
		}, []string{"pool", "namespace"}),
		discarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "discarded_total",
			Help: "Members destroyed without running a workload, by reason.",
		}, []string{"pool", "reason"}),
		ageAtClaim: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "member_age_at_claim_seconds",
			Help:    "How long members waited, frozen, before a claim took them.",
			Buckets: prometheus.ExponentialBuckets(0.1, 3, 12),
		}, []string{"pool"}),
		oldestIdle: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "tidepool", Subsystem: "pool", Name: "oldest_idle_member_age_seconds",
			Help: "Age of the oldest idle member, by containerd namespace.",
		}, []string{"pool", "namespace"}),
	}
}

func (m *Metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.members, m.claimSeconds, m.coldFallbacks, m.adoptions, m.discarded, m.ageAtClaim, m.oldestIdle}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}

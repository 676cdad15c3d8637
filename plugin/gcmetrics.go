package plugin

import "github.com/prometheus/client_golang/prometheus"

// gcMetrics count tidepoold's periodic garbage collections (maintenance.gc_interval),
// so that an operator sees that they run, what they free, and how many roots they keep
// only because a kernel view shows them.
type gcMetrics struct {
	runs      *prometheus.CounterVec
	swept     prometheus.Counter
	freed     prometheus.Counter
	viewRoots prometheus.Gauge
}

func newGCMetrics() *gcMetrics {
	return &gcMetrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_gc_runs_total",
			Help: "Periodic garbage collections by result: ok, failed, or skipped (the roots of mounted kernel views could not be listed).",
		}, []string{"result"}),
		swept: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tidepool_gc_swept_objects_total",
			Help: "Objects removed by periodic garbage collections.",
		}),
		freed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tidepool_gc_freed_bytes_total",
			Help: "Bytes of objects removed by periodic garbage collections.",
		}),
		viewRoots: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tidepool_gc_kernel_view_roots",
			Help: "Roots of mounted kernel views the last periodic garbage collection marked from, whatever the view mode.",
		}),
	}
}

// collectors are the metrics, each registered as it is.
func (m *gcMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.runs, m.swept, m.freed, m.viewRoots}
}

package remote

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics counts a remote's traffic. It is a prometheus.Collector (tidepoold
// registers it) and can be read directly with Snapshot (the CLI and tests).
type Metrics struct {
	requests       atomic.Int64
	objectsFetched atomic.Int64
	bytesFetched   atomic.Int64
	objectsPushed  atomic.Int64
	bytesPushed    atomic.Int64
	verifyFailures atomic.Int64
	casConflicts   atomic.Int64
	packsPushed    atomic.Int64
	packsFetched   atomic.Int64
	packFailures   atomic.Int64

	seconds *prometheus.HistogramVec
	descs   []*prometheus.Desc
}

// Stats is a snapshot of Metrics.
type Stats struct {
	Requests       int64 `json:"requests"` // HTTP requests, retries included
	ObjectsFetched int64 `json:"objects_fetched"`
	BytesFetched   int64 `json:"bytes_fetched"`
	ObjectsPushed  int64 `json:"objects_pushed"`
	BytesPushed    int64 `json:"bytes_pushed"`
	VerifyFailures int64 `json:"verify_failures"`
	CASConflicts   int64 `json:"cas_conflicts"`
	PacksPushed    int64 `json:"packs_pushed"`
	PacksFetched   int64 `json:"packs_fetched"` // read to their end
	PackFailures   int64 `json:"pack_failures"` // corrupt or truncated: the pull went on object by object
}

// Sub returns s - t, the traffic between two snapshots.
func (s Stats) Sub(t Stats) Stats {
	return Stats{
		Requests: s.Requests - t.Requests, ObjectsFetched: s.ObjectsFetched - t.ObjectsFetched,
		BytesFetched: s.BytesFetched - t.BytesFetched, ObjectsPushed: s.ObjectsPushed - t.ObjectsPushed,
		BytesPushed: s.BytesPushed - t.BytesPushed, VerifyFailures: s.VerifyFailures - t.VerifyFailures,
		CASConflicts: s.CASConflicts - t.CASConflicts, PacksPushed: s.PacksPushed - t.PacksPushed,
		PacksFetched: s.PacksFetched - t.PacksFetched, PackFailures: s.PackFailures - t.PackFailures,
	}
}

// NewMetrics makes an empty set of counters.
func NewMetrics() *Metrics {
	m := &Metrics{
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "tidepool", Subsystem: "remote", Name: "request_duration_seconds",
			Help:    "Latency of object-store operations by operation (head_blob, get_blob, put_blob, get_pack, put_pack, get_ref, put_ref, list_refs, delete_ref) and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 14),
		}, []string{"op", "outcome"}),
	}
	return m
}

// Snapshot reads the counters.
func (m *Metrics) Snapshot() Stats {
	return Stats{
		Requests: m.requests.Load(), ObjectsFetched: m.objectsFetched.Load(), BytesFetched: m.bytesFetched.Load(),
		ObjectsPushed: m.objectsPushed.Load(), BytesPushed: m.bytesPushed.Load(),
		VerifyFailures: m.verifyFailures.Load(), CASConflicts: m.casConflicts.Load(),
		PacksPushed: m.packsPushed.Load(), PacksFetched: m.packsFetched.Load(), PackFailures: m.packFailures.Load(),
	}
}

func (m *Metrics) observe(op string, d time.Duration, err error) {
	m.seconds.WithLabelValues(op, outcome(err)).Observe(d.Seconds())
}

func outcome(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errdefs.IsNotFound(err):
		return "not_found"
	case errdefs.IsFailedPrecondition(err):
		return "precondition_failed"
	case errdefs.IsPermissionDenied(err):
		return "denied"
	case errors.Is(err, errdefs.ErrUnavailable):
		return "unavailable"
	default:
		return "error"
	}
}

type counter struct {
	name, help string
	v          *atomic.Int64
}

func (m *Metrics) counters() []counter {
	return []counter{
		{"requests_total", "HTTP requests sent to the object store, retries included.", &m.requests},
		{"objects_fetched_total", "Objects fetched from the object store and verified.", &m.objectsFetched},
		{"bytes_fetched_total", "Bytes of verified objects fetched from the object store.", &m.bytesFetched},
		{"objects_pushed_total", "Objects uploaded to the object store.", &m.objectsPushed},
		{"bytes_pushed_total", "Bytes uploaded to the object store.", &m.bytesPushed},
		{"verify_failures_total", "Fetched objects refused because their bytes did not hash to their name.", &m.verifyFailures},
		{"packs_pushed_total", "Packs (one object holding what a push uploaded) written beside the blobs.", &m.packsPushed},
		{"packs_fetched_total", "Packs a pull read to their end.", &m.packsFetched},
		{"pack_failures_total", "Packs a pull could not use to their end (corrupt or truncated); it fetched the rest object by object.", &m.packFailures},
		{"cas_conflicts_total", "Ref compare-and-swaps lost to a concurrent writer (a conflict ref was written).", &m.casConflicts},
	}
}

func desc(c counter) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName("tidepool", "remote", c.name), c.help, nil, nil)
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.counters() {
		ch <- desc(c)
	}
	m.seconds.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.counters() {
		ch <- prometheus.MustNewConstMetric(desc(c), prometheus.CounterValue, float64(c.v.Load()))
	}
	m.seconds.Collect(ch)
}

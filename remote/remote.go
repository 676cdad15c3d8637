package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/tidepool-dev/tidepool/casstore"
)

// DefaultConcurrency is how many requests a push or pull keeps in flight.
const DefaultConcurrency = 32

// maxTreeSize bounds a tree object read into memory (the store's own limit).
const maxTreeSize = 256 << 20

// Remote is one bucket prefix in LunarFS's server layout.
type Remote struct {
	loc     location
	core    minio.Core
	conc    int
	noPacks bool
	metrics *Metrics
}

// Open makes a client for cfg. It sends no request: a bucket that is unreachable or
// refuses the credentials is reported by the first operation, naming the remote.
func Open(cfg Config) (*Remote, error) {
	loc, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	m := NewMetrics()
	conc := cfg.Concurrency
	if conc <= 0 {
		conc = DefaultConcurrency
	}
	base, err := minio.DefaultTransport(loc.secure)
	if err != nil {
		return nil, fmt.Errorf("remote %s: %w", loc.url, err)
	}
	// Keep a connection per request in flight: with fewer idle slots than workers,
	// every round trip beyond them would open (and leave in TIME_WAIT) a new one.
	base.MaxIdleConnsPerHost = 2 * conc
	base.MaxIdleConns = 4 * conc
	var creds *credentials.Credentials
	if os.Getenv("AWS_ACCESS_KEY_ID") != "" || os.Getenv("AWS_SECRET_ACCESS_KEY") != "" {
		creds = credentials.NewEnvAWS()
	} else {
		creds = credentials.NewStatic("", "", "", credentials.SignatureAnonymous)
	}
	c, err := minio.New(loc.host, &minio.Options{
		Creds:        creds,
		Secure:       loc.secure,
		Region:       loc.region, // set, so no GetBucketLocation round trip
		Transport:    &countingTransport{base: base, n: &m.requests},
		BucketLookup: minio.BucketLookupPath,
		MaxRetries:   3,
	})
	if err != nil {
		return nil, fmt.Errorf("remote %s: %w", loc.url, err)
	}
	return &Remote{loc: loc, core: minio.Core{Client: c}, conc: conc, noPacks: cfg.NoPacks, metrics: m}, nil
}

// String names the remote (s3://BUCKET/PREFIX/) for messages.
func (r *Remote) String() string { return r.loc.url }

// Metrics returns the remote's counters; it is a prometheus.Collector.
func (r *Remote) Metrics() *Metrics { return r.metrics }

// BlobKey is where object h lives in the bucket: PREFIX/blobs/<hh>/<62 hex>.
func (r *Remote) BlobKey(h casstore.Hash) string { return r.loc.prefix + BlobPath(h) }

// RefKey is where ref name lives in the bucket: PREFIX/ref/<name>.
func (r *Remote) RefKey(name string) string { return r.loc.prefix + "ref/" + name }

// BlobPath is an object's key below the prefix, as LunarFS's server writes it.
func BlobPath(h casstore.Hash) string {
	x := h.String()
	return "blobs/" + x[:2] + "/" + x[2:]
}

// countingTransport counts HTTP requests (retries included), which is what a push's
// or pull's request budget is measured in.
type countingTransport struct {
	base http.RoundTripper
	n    *atomic.Int64
}

func (t *countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t.n.Add(1)
	return t.base.RoundTrip(req)
}

// observe records one operation's latency and outcome.
func (r *Remote) observe(op string, start time.Time, err error) {
	r.metrics.observe(op, time.Since(start), err)
}

// wrap turns a client error into one line that names the remote and, for the cases a
// caller acts on, wraps the matching errdefs error.
func (r *Remote) wrap(op, key string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("remote %s: %s %s: %w", r.loc.url, op, key, err)
	}
	var resp minio.ErrorResponse
	if errors.As(err, &resp) {
		switch resp.Code {
		case "NoSuchKey", "NotFound":
			return fmt.Errorf("remote %s: %s %s: not found: %w", r.loc.url, op, key, errdefs.ErrNotFound)
		case "NoSuchBucket":
			return fmt.Errorf("remote %s: bucket %q does not exist: %w", r.loc.url, r.loc.bucket, errdefs.ErrNotFound)
		case "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken":
			return fmt.Errorf("remote %s: access denied (%s) on %s %s: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: %w",
				r.loc.url, resp.Code, op, key, errdefs.ErrPermissionDenied)
		case "PreconditionFailed", "ConditionalRequestConflict":
			return fmt.Errorf("remote %s: %s %s: precondition failed: %w", r.loc.url, op, key, errdefs.ErrFailedPrecondition)
		}
		if resp.StatusCode == http.StatusForbidden {
			return fmt.Errorf("remote %s: access denied on %s %s: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: %w",
				r.loc.url, op, key, errdefs.ErrPermissionDenied)
		}
		if resp.StatusCode == http.StatusNotFound {
			return fmt.Errorf("remote %s: %s %s: not found: %w", r.loc.url, op, key, errdefs.ErrNotFound)
		}
		if resp.Code != "" {
			return fmt.Errorf("remote %s: %s %s: %s (%s, HTTP %d): %w", r.loc.url, op, key, resp.Message, resp.Code, resp.StatusCode, errdefs.ErrUnavailable)
		}
	}
	return fmt.Errorf("remote %s unreachable at %s: %s %s: %v: %w", r.loc.url, r.loc.host, op, key, err, errdefs.ErrUnavailable)
}

// HasBlob reports whether the bucket holds object h (one HEAD request).
func (r *Remote) HasBlob(ctx context.Context, h casstore.Hash) (bool, error) {
	_, err := r.Stat(ctx, h)
	if errdefs.IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// Stat returns the size of object h in the bucket; an absent object is an error
// wrapping errdefs.ErrNotFound. With Fetch it makes Remote a fuse.BlobSource.
func (r *Remote) Stat(ctx context.Context, h casstore.Hash) (int64, error) {
	start := time.Now()
	key := r.BlobKey(h)
	info, err := r.core.StatObject(ctx, r.loc.bucket, key, minio.StatObjectOptions{})
	err = r.wrap("HEAD", key, err)
	r.observe("head_blob", start, err)
	if err != nil {
		return 0, err
	}
	return info.Size, nil
}

// Fetch streams object h from the bucket. The stream hashes what it passes on and
// fails at its end, instead of reporting io.EOF, if the bytes do not hash to h; the
// failure is counted. Callers still verify (the store's PutExpect does).
func (r *Remote) Fetch(ctx context.Context, h casstore.Hash) (io.ReadCloser, error) {
	start := time.Now()
	key := r.BlobKey(h)
	body, info, _, err := r.core.GetObject(ctx, r.loc.bucket, key, minio.GetObjectOptions{})
	err = r.wrap("GET", key, err)
	r.observe("get_blob", start, err)
	if err != nil {
		return nil, err
	}
	return newVerifyingReader(body, h, info.Size, r), nil
}

// fetchBytes GETs a small object whole and verifies it.
func (r *Remote) fetchBytes(ctx context.Context, h casstore.Hash, max int64) ([]byte, error) {
	rc, err := r.Fetch(ctx, h)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("remote %s: object %s is larger than the %d bytes allowed for a tree", r.loc.url, h, max)
	}
	return b, nil
}

// putBlob uploads object h from the local store (one PUT; multipart above 16 MiB).
func (r *Remote) putBlob(ctx context.Context, store *casstore.Store, h casstore.Hash) (int64, error) {
	f, err := store.Open(h) // verified: a corrupt local object is never pushed
	if err != nil {
		return 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	key := r.BlobKey(h)
	_, err = r.core.Client.PutObject(ctx, r.loc.bucket, key, f, st.Size(), minio.PutObjectOptions{
		ContentType:      "application/octet-stream",
		DisableMultipart: st.Size() < 64<<20,
		PartSize:         16 << 20,
	})
	err = r.wrap("PUT", key, err)
	r.observe("put_blob", start, err)
	if err != nil {
		return 0, err
	}
	r.metrics.objectsPushed.Add(1)
	r.metrics.bytesPushed.Add(st.Size())
	return st.Size(), nil
}

// putBytes uploads a small in-memory object (a tree) under its hash.
func (r *Remote) putBytes(ctx context.Context, h casstore.Hash, data []byte) error {
	start := time.Now()
	key := r.BlobKey(h)
	_, err := r.core.Client.PutObject(ctx, r.loc.bucket, key, bytesReader(data), int64(len(data)), minio.PutObjectOptions{
		ContentType: "application/octet-stream", DisableMultipart: true,
	})
	err = r.wrap("PUT", key, err)
	r.observe("put_blob", start, err)
	if err == nil {
		r.metrics.objectsPushed.Add(1)
		r.metrics.bytesPushed.Add(int64(len(data)))
	}
	return err
}

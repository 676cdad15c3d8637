package remote

import (
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/containerd/errdefs"
)

// Config says which bucket to use and how to reach it. Credentials are not part of
// it: they come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
// optionally AWS_SESSION_TOKEN), as every S3 tool expects.
type Config struct {
	// URL is s3://BUCKET[/PREFIX].
	URL string `toml:"url" json:"url"`
	// Endpoint is the S3 endpoint for MinIO, R2, RGW...: "https://host[:port]", or
	// "http://host:port" to allow plain HTTP (only when written out like that).
	// Empty: AWS_ENDPOINT_URL, then LunarFS's AWS_ENDPOINT, then AWS S3.
	Endpoint string `toml:"endpoint" json:"endpoint"`
	// Region signs requests. Empty: AWS_REGION, then AWS_DEFAULT_REGION, then us-east-1.
	Region string `toml:"region" json:"region"`
	// Concurrency is how many requests a push or pull keeps in flight (0: 32).
	Concurrency int `toml:"concurrency,omitempty" json:"concurrency,omitempty"`
	// NoPacks keeps to LunarFS's layout alone: a push writes no pack and a pull reads
	// none (every object is fetched with its own GET). See pack.go.
	NoPacks bool `toml:"no_packs,omitempty" json:"no_packs,omitempty"`
}

// Enabled reports whether a remote is configured.
func (c Config) Enabled() bool { return c.URL != "" }

// location is a parsed Config: where the objects live and how to reach them.
type location struct {
	bucket string
	prefix string // "" or "PREFIX/"
	host   string // host[:port]
	secure bool
	region string
	url    string // s3://bucket/prefix, for messages
}

// ParseURL splits s3://BUCKET[/PREFIX] into the bucket and the key prefix ("" or
// ending in "/").
func ParseURL(s string) (bucket, prefix string, err error) {
	u, err := url.Parse(s)
	if err != nil {
		return "", "", fmt.Errorf("remote url %q: %w: %w", s, err, errdefs.ErrInvalidArgument)
	}
	if u.Scheme != "s3" {
		return "", "", fmt.Errorf("remote url %q: want s3://BUCKET[/PREFIX]: %w", s, errdefs.ErrInvalidArgument)
	}
	if u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", "", fmt.Errorf("remote url %q: want s3://BUCKET[/PREFIX] with no user, query or fragment: %w", s, errdefs.ErrInvalidArgument)
	}
	p := strings.Trim(u.Path, "/")
	for _, seg := range strings.Split(p, "/") {
		if p != "" && (seg == "" || seg == "." || seg == "..") {
			return "", "", fmt.Errorf("remote url %q: prefix segment %q is not allowed: %w", s, seg, errdefs.ErrInvalidArgument)
		}
	}
	if p != "" {
		p += "/"
	}
	return u.Host, p, nil
}

func (c Config) resolve() (location, error) {
	if c.URL == "" {
		return location{}, fmt.Errorf("no remote configured (--remote s3://BUCKET/PREFIX or [remote] url): %w", errdefs.ErrInvalidArgument)
	}
	bucket, prefix, err := ParseURL(c.URL)
	if err != nil {
		return location{}, err
	}
	l := location{bucket: bucket, prefix: prefix, url: "s3://" + bucket + "/" + prefix}
	ep := firstNonEmpty(c.Endpoint, os.Getenv("AWS_ENDPOINT_URL"), os.Getenv("AWS_ENDPOINT"))
	l.region = firstNonEmpty(c.Region, os.Getenv("AWS_REGION"), os.Getenv("AWS_DEFAULT_REGION"), "us-east-1")
	if ep == "" {
		l.host, l.secure = "s3.amazonaws.com", true
		if l.region != "us-east-1" {
			l.host = "s3." + l.region + ".amazonaws.com"
		}
		return l, nil
	}
	switch {
	case strings.HasPrefix(ep, "http://"), strings.HasPrefix(ep, "https://"):
		u, err := url.Parse(ep)
		if err != nil {
			return location{}, fmt.Errorf("remote endpoint %q: %w: %w", ep, err, errdefs.ErrInvalidArgument)
		}
		if u.Host == "" || strings.Trim(u.Path, "/") != "" || u.RawQuery != "" || u.User != nil {
			return location{}, fmt.Errorf("remote endpoint %q: want http(s)://HOST[:PORT] with no path: %w", ep, errdefs.ErrInvalidArgument)
		}
		l.host, l.secure = u.Host, u.Scheme == "https"
	case strings.Contains(ep, "/"):
		return location{}, fmt.Errorf("remote endpoint %q: want http(s)://HOST[:PORT]: %w", ep, errdefs.ErrInvalidArgument)
	default:
		l.host, l.secure = ep, true // no scheme: TLS, never silently plain
	}
	return l, nil
}

func firstNonEmpty(v ...string) string {
	for _, s := range v {
		if s != "" {
			return s
		}
	}
	return ""
}

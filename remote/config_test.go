package remote

import (
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

func TestParseURL(t *testing.T) {
	for in, want := range map[string][2]string{
		"s3://b":             {"b", ""},
		"s3://b/":            {"b", ""},
		"s3://b/team/fleet":  {"b", "team/fleet/"},
		"s3://b/team/fleet/": {"b", "team/fleet/"},
		"s3://my.bucket/x":   {"my.bucket", "x/"},
	} {
		b, p, err := ParseURL(in)
		if err != nil || b != want[0] || p != want[1] {
			t.Errorf("ParseURL(%q) = %q, %q, %v; want %q, %q", in, b, p, err, want[0], want[1])
		}
	}
	for _, bad := range []string{"", "b/p", "http://b/p", "s3:///p", "s3://b/../x", "s3://b/a//c", "s3://u@b/p", "s3://b/p?x=1"} {
		if _, _, err := ParseURL(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("ParseURL(%q): want an invalid-argument error, got %v", bad, err)
		}
	}
}

func TestResolveEndpoint(t *testing.T) {
	t.Setenv("AWS_ENDPOINT_URL", "")
	t.Setenv("AWS_ENDPOINT", "")
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	cases := []struct {
		cfg          Config
		env          map[string]string
		host, region string
		secure       bool
	}{
		{cfg: Config{URL: "s3://b"}, host: "s3.amazonaws.com", region: "us-east-1", secure: true},
		{cfg: Config{URL: "s3://b", Region: "eu-west-1"}, host: "s3.eu-west-1.amazonaws.com", region: "eu-west-1", secure: true},
		{cfg: Config{URL: "s3://b", Endpoint: "http://127.0.0.1:9000"}, host: "127.0.0.1:9000", region: "us-east-1"},
		{cfg: Config{URL: "s3://b", Endpoint: "minio.lan:9000"}, host: "minio.lan:9000", region: "us-east-1", secure: true},
		{cfg: Config{URL: "s3://b"}, env: map[string]string{"AWS_ENDPOINT": "http://lunar:9000", "AWS_REGION": "auto"}, host: "lunar:9000", region: "auto"},
		{cfg: Config{URL: "s3://b"}, env: map[string]string{"AWS_ENDPOINT": "http://lunar:9000", "AWS_ENDPOINT_URL": "https://r2.example"}, host: "r2.example", region: "us-east-1", secure: true},
	}
	for _, c := range cases {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		l, err := c.cfg.resolve()
		if err != nil || l.host != c.host || l.region != c.region || l.secure != c.secure {
			t.Errorf("%+v with %v: got %+v, %v", c.cfg, c.env, l, err)
		}
		for k := range c.env {
			t.Setenv(k, "")
		}
	}
	for _, ep := range []string{"http://h:1/path", "ftp://h", "h/x"} {
		if _, err := (Config{URL: "s3://b", Endpoint: ep}).resolve(); !errdefs.IsInvalidArgument(err) {
			t.Errorf("endpoint %q: want invalid argument, got %v", ep, err)
		}
	}
}

func TestRefCodec(t *testing.T) {
	root := casstore.Sum([]byte("x"))
	b := EncodeRef(root)
	if want := `{"root":"` + root.String() + `"}`; string(b) != want {
		t.Fatalf("EncodeRef = %s, want %s", b, want)
	}
	if got, err := DecodeRef(b); err != nil || got != root {
		t.Fatalf("DecodeRef(%s) = %s, %v", b, got, err)
	}
	for _, bad := range []string{``, `{}`, `{"root":""}`, `{"root":"` + strings.ToUpper(root.String()) + `"}`, `{"root":1}`, `not json`} {
		if _, err := DecodeRef([]byte(bad)); err == nil {
			t.Errorf("DecodeRef(%q) accepted", bad)
		}
	}
	// G13 of the LunarFS format notes.
	h, _ := casstore.ParseHash("1234567890abcdef" + strings.Repeat("0", 48))
	if got := ConflictName("ws-conflict", h); got != "ws-conflict@conflict-12345678" {
		t.Fatalf("ConflictName = %q", got)
	}
	for _, ok := range []string{"main", "ws-conflict@conflict-12345678", "a.b_c-d", "0"} {
		if err := CheckRefName(ok); err != nil {
			t.Errorf("CheckRefName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".", "..", "a/b", "../x", ".hidden", "a..b", "a b", "-x", "@x", strings.Repeat("a", 201), "a\x00"} {
		if err := CheckRefName(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("CheckRefName(%q) = %v, want invalid argument", bad, err)
		}
	}
	if got := BlobPath(casstore.EmptyHash); got != "blobs/af/1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262" {
		t.Fatalf("BlobPath(E) = %s", got)
	}
}

package main

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func TestRunArgs(t *testing.T) {
	for _, tc := range []struct {
		args  string
		front bool
	}{
		{"run --pool p -- true", true},
		{"--root /r run --pool p -- true", true},
		{"--root=/r --api-address /a.sock --log-level=debug run --pool p --fork f -q -- sh -c x", true},
		{"run --pool p -- grep --help", true}, // the workload's --help is the workload's
		{"run --help", false},
		{"run --pool p -h", false},
		{"pools", false},
		{"--store /s run --pool p -- true", false}, // a global flag only the full CLI knows
		{"fork --container x", false},
		{"", false},
		{"--help", false},
	} {
		_, got := runArgs(strings.Fields(tc.args))
		if got != tc.front {
			t.Errorf("%q: served by the front %v, want %v", tc.args, got, tc.front)
		}
	}
}

// TestFrontStaysSmall: the front's point is its start-up time; it must not link the
// full CLI's dependencies (containerd's client, gRPC, the S3 client, Prometheus, cobra,
// the store).
func TestFrontStaysSmall(t *testing.T) {
	out, err := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/containerd/", "google.golang.org/grpc", "google.golang.org/protobuf",
			"github.com/minio/", "github.com/prometheus/", "github.com/spf13/cobra", "github.com/distribution/",
			"github.com/tidepool-dev/tidepool/casstore", "github.com/tidepool-dev/tidepool/pool", "github.com/tidepool-dev/tidepool/localapi/apiserver"} {
			if strings.HasPrefix(dep, banned) {
				t.Errorf("the front links %s", dep)
			}
		}
	}
}

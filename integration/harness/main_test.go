package harness

import (
	"flag"
	"fmt"
	"os"
	"testing"
)

// TestMain skips the whole package unless it runs as root: every test here
// starts containerd, mounts and creates cgroups. `go test -short` (make
// unit-test) skips it too.
func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Println("integration/harness: skipping, the real-stack tests need root")
		os.Exit(0)
	}
	if testing.Short() {
		fmt.Println("integration/harness: skipping the real-stack tests in -short mode")
		os.Exit(0)
	}
	os.Exit(m.Run())
}

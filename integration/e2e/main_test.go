// Package e2e holds Tidepool's real-stack tests: a private containerd 2.4.2 with real
// runc, tidepoold as its proxy snapshotter, real FUSE views and overlay mounts, images
// built locally and imported with ctr. They need root; as anyone else they skip.
package e2e

import (
	"os"
	"testing"

	"github.com/tidepool-dev/tidepool/integration/stack"
)

func TestMain(m *testing.M) {
	code := m.Run()
	stack.RemoveBinaries()
	os.Exit(code)
}

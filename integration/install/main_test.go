// Package install holds the real-stack tests of putting Tidepool on a host: `tidepool
// doctor` against a private containerd and tidepoold, and `tidepool install` /
// `uninstall` on a temporary host root whose containerd then runs a container through
// the shim. They need root; as anyone else they skip.
package install

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

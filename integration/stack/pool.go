package stack

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
)

// Pool is one warm pool template, for PoolConfig.
type Pool struct {
	Name    string
	Image   string
	Workdir string // where members get their fork; default /app
	Target  int
	Extra   string // more lines of the template, verbatim
}

// PoolConfig is tidepoold's configuration for one pool in the stack's containerd:
// members run the stack's tidepool-holder through the shim, which reaches this
// stack's tidepoold (a shim config written next to the stack), as root, with at most
// twice the target and a refill fast enough for tests.
func (s *Stack) PoolConfig(p Pool) string {
	shimCfg := filepath.Join(s.Dir, "shim.toml")
	if err := os.WriteFile(shimCfg, []byte(fmt.Sprintf("api_address = %q\n", s.APIAddress)), 0o600); err != nil {
		panic(fmt.Sprintf("write %s: %v", shimCfg, err)) // the stack's own temp dir: cannot fail short of a broken host
	}
	return fmt.Sprintf(`
[pools]
namespaces = [%q]
holder = %q
shim_config = %q
[[pools.template]]
name = %q
image = %q
workdir = %q
owner = "0:0"
min = 1
target = %d
max = %d
refill_rate = 20.0
max_age = "1h"
%s`, s.C.Namespace, filepath.Join(s.Bin, "tidepool-holder"), shimCfg, p.Name, p.Image,
		cmp.Or(p.Workdir, "/app"), p.Target, 2*p.Target, p.Extra)
}

package plugin

import (
	"strings"
	"testing"
)

// TestValidateLayerPaths: a root or store whose path overlayfs options cannot carry
// is refused up front, naming the key and the character.
func TestValidateLayerPaths(t *testing.T) {
	for _, c := range []struct {
		root, store, want string
	}{
		{root: "/var/lib/tidepool"},
		{root: "/var/lib/tidepool", store: "/home/me/.lunar/cas"},
		{root: "/var/lib/tide,pool", want: `root "/var/lib/tide,pool": a path with ','`},
		{root: "/var/lib/tide:pool", want: `root "/var/lib/tide:pool": a path with ':'`},
		{root: "/var/lib/tidepool", store: "/data/cas:1", want: `store.path "/data/cas:1": a path with ':'`},
	} {
		cfg := DefaultConfig()
		cfg.Root, cfg.Store.Path = c.root, c.store
		err := cfg.Validate()
		switch {
		case c.want == "" && err != nil:
			t.Errorf("root %q store %q: %v", c.root, c.store, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("root %q store %q: %v, want an error containing %q", c.root, c.store, err, c.want)
		}
	}
}

package plugin

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestPoolNamespacesConfig: by default a pool serves namespace "default" (ctr's and
// nerdctl's), so a transparent claim works with the shipped configuration; a list in
// the file replaces the default (not appended to it); a template may name its own;
// the old single-namespace key still works and overrides the list.
func TestPoolNamespacesConfig(t *testing.T) {
	load := func(body string) *Config {
		t.Helper()
		p := filepath.Join(t.TempDir(), "tidepoold.toml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadConfig(p, true)
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	const tmpl = "\n[[pools.template]]\nname = 'node'\nimage = 'example.com/node:1'\n"
	for _, tc := range []struct {
		name, body string
		want       []string // the controller's default namespaces
		tmpl       []string // the template's own
	}{
		{"shipped default", "[pools]" + tmpl, []string{"default"}, nil},
		{"list replaces the default", "[pools]\nnamespaces = ['k8s.io']" + tmpl, []string{"k8s.io"}, nil},
		{"two namespaces", "[pools]\nnamespaces = ['default', 'k8s.io']" + tmpl, []string{"default", "k8s.io"}, nil},
		{"per template", "[pools]" + tmpl + "namespaces = ['k8s.io']\n", []string{"default"}, []string{"k8s.io"}},
		{"deprecated key", "[pools]\nnamespace = 'tidepool'" + tmpl, []string{"tidepool"}, nil},
	} {
		pc := poolConfig(load(tc.body))
		if !slices.Equal(pc.Namespaces, tc.want) || len(pc.Templates) != 1 || !slices.Equal(pc.Templates[0].Namespaces, tc.tmpl) {
			t.Errorf("%s: namespaces %q, template %+v", tc.name, pc.Namespaces, pc.Templates)
		}
	}
}

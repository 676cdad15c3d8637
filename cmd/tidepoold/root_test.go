package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRootOverlayCannotCarry: tidepoold refuses, before it creates or serves
// anything, a root whose path (as given, or its real path behind a symbolic link)
// overlayfs mount options cannot carry, and says why.
func TestRootOverlayCannotCarry(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "tidepoold.toml")
	if err := os.WriteFile(config, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(dir, "state:1")
	if err := os.Mkdir(real, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "state")
	if err := os.Symlink("state:1", link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ root, want string }{
		{filepath.Join(dir, "a,b"), `a path with ','`},
		{link, `a path with ':' cannot be an overlayfs layer (mount options separate with ',' and layers with ':') (its real path)`},
	} {
		err := run([]string{"--config", config, "--root", c.root, "--address", filepath.Join(dir, "s.sock"),
			"--api-address", filepath.Join(dir, "a.sock"), "--metrics-address", "none", "--containerd-address", "none"})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("root %s: %v; want an error containing %q", c.root, err, c.want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "a,b")); !os.IsNotExist(err) {
		t.Errorf("the refused root was created: %v", err)
	}
	if ents, _ := os.ReadDir(real); len(ents) != 0 {
		t.Errorf("the refused root's real directory was written to: %v", ents)
	}
}

// Package testenv locates what the real-stack tests need on this machine: the
// repository root, the cache directory, the pinned tools (containerd, ctr, runc)
// and the project's own binaries. It exists so every integration package finds
// them the same way, and skips with one clear message when they are missing.
package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// ModulePath is the Go module whose checkout is the repository root.
const ModulePath = "github.com/tidepool-dev/tidepool"

var (
	rootOnce sync.Once
	rootDir  string
	rootErr  error
)

// RepoRoot returns the repository root: the nearest directory at or above the
// working directory whose go.mod declares ModulePath. Tests run in their
// package directory, so this finds the checkout without configuration.
func RepoRoot() (string, error) {
	rootOnce.Do(func() {
		dir, err := os.Getwd()
		if err != nil {
			rootErr = fmt.Errorf("find repository root: %w", err)
			return
		}
		for {
			data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
			if err == nil && declaresModule(string(data)) {
				rootDir = dir
				return
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				rootErr = fmt.Errorf("find repository root: no go.mod for %s above the working directory", ModulePath)
				return
			}
			dir = parent
		}
	})
	return rootDir, rootErr
}

func declaresModule(gomod string) bool {
	for _, line := range strings.Split(gomod, "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == "module" && f[1] == ModulePath {
			return true
		}
	}
	return false
}

// CacheDir returns (creating it) a directory for slow-to-build test inputs
// (image archives, npm trees, helper binaries) that survives between runs:
// $TIDEPOOL_CACHE_DIR if set, else <repo>/.cache, joined with sub.
func CacheDir(sub string) (string, error) {
	base := os.Getenv("TIDEPOOL_CACHE_DIR")
	if base == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		base = filepath.Join(root, ".cache")
	}
	dir := filepath.Join(base, sub)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("create cache dir: %w", err)
	}
	return dir, nil
}

// DepsBin is the directory holding the pinned containerd, ctr, shim and runc:
// $TIDEPOOL_DEPS_BIN (exported by the Makefile), else <repo>/.deps/bin. It
// returns "" when neither is known; tools then come from $PATH.
func DepsBin() string {
	if d := os.Getenv("TIDEPOOL_DEPS_BIN"); d != "" {
		return d
	}
	if root, err := RepoRoot(); err == nil {
		return filepath.Join(root, ".deps", "bin")
	}
	return ""
}

// ProjectBin is the directory `make build` writes tidepool, tidepoold and
// containerd-shim-tidepool-v1 to: $TIDEPOOL_BIN, else <repo>/bin ("" if unknown).
func ProjectBin() string {
	if d := os.Getenv("TIDEPOOL_BIN"); d != "" {
		return d
	}
	if root, err := RepoRoot(); err == nil {
		return filepath.Join(root, "bin")
	}
	return ""
}

// SearchPath is the PATH given to daemons under test: the project binaries,
// then the pinned tools, then the inherited PATH. containerd resolves shims
// (containerd-shim-<name>-<version>) by name on it, and the runc shim finds runc.
func SearchPath() string {
	var parts []string
	for _, d := range []string{ProjectBin(), DepsBin()} {
		if d != "" {
			parts = append(parts, d)
		}
	}
	if p := os.Getenv("PATH"); p != "" {
		parts = append(parts, p)
	}
	return strings.Join(parts, string(os.PathListSeparator))
}

// Tool returns the path of a pinned tool (containerd, ctr, runc, ...): the deps
// bin first, then the project bin, then $PATH.
func Tool(name string) (string, error) {
	for _, d := range []string{DepsBin(), ProjectBin()} {
		if d == "" {
			continue
		}
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	p, err := exec.LookPath(name)
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return "", fmt.Errorf("%s not found in %q, %q or $PATH (run `make deps`): %w", name, DepsBin(), ProjectBin(), err)
		}
		return "", fmt.Errorf("look up %s: %w", name, err)
	}
	return p, nil
}

// RequireRoot skips the test unless it runs as root, and in -short mode
// (`make unit-test` runs only what needs neither root nor the tools).
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root (mounts, cgroups, containerd)")
	}
	if testing.Short() {
		t.Skip("skipping real-stack test in -short mode")
	}
}

// RequireTools skips the test when one of the named tools is missing, naming it.
func RequireTools(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := Tool(n); err != nil {
			t.Skipf("skipping: %v", err)
		}
	}
}

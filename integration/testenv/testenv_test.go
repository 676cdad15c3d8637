package testenv

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRepoRootIsTheModule(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil || !declaresModule(string(data)) {
		t.Fatalf("%s/go.mod does not declare %s (%v)", root, ModulePath, err)
	}
	if !declaresModule("// x\nmodule "+ModulePath+"\n\ngo 1.26\n") || declaresModule("module "+ModulePath+"/other\n") {
		t.Fatal("declaresModule matches the wrong module lines")
	}
}

func TestToolsComeFromTheDepsBinFirst(t *testing.T) {
	deps, project := t.TempDir(), t.TempDir()
	for _, f := range []string{filepath.Join(deps, "runc"), filepath.Join(project, "runc"), filepath.Join(project, "tidepoold")} {
		if err := os.WriteFile(f, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(deps, "notexec"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TIDEPOOL_DEPS_BIN", deps)
	t.Setenv("TIDEPOOL_BIN", project)
	t.Setenv("PATH", "/nonexistent")
	if p, err := Tool("runc"); err != nil || p != filepath.Join(deps, "runc") {
		t.Fatalf("Tool(runc) = %s, %v; want the deps bin", p, err)
	}
	if p, err := Tool("tidepoold"); err != nil || p != filepath.Join(project, "tidepoold") {
		t.Fatalf("Tool(tidepoold) = %s, %v", p, err)
	}
	if _, err := Tool("notexec"); err == nil {
		t.Fatal("a non-executable file was accepted as a tool")
	}
	if _, err := Tool("absent-tool"); err == nil || !strings.Contains(err.Error(), "make deps") {
		t.Fatalf("missing tool: %v", err)
	}
	if got, want := SearchPath(), project+":"+deps+":/nonexistent"; got != want {
		t.Fatalf("SearchPath = %s, want %s", got, want)
	}
}

func TestCacheDirHonoursTheEnvironment(t *testing.T) {
	base := t.TempDir()
	t.Setenv("TIDEPOOL_CACHE_DIR", base)
	dir, err := CacheDir("images")
	if err != nil || dir != filepath.Join(base, "images") {
		t.Fatalf("CacheDir = %s, %v", dir, err)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		t.Fatalf("cache dir not created: %v", err)
	}
}

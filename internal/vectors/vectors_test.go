package vectors

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadEmbeddedCopy(t *testing.T) {
	t.Setenv(EnvVar, "")
	f, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	if f.EmptyHash == "" || len(f.Trees) == 0 || len(f.Directories) == 0 {
		t.Fatalf("embedded vectors are incomplete: %d trees, %d directories, empty hash %q", len(f.Trees), len(f.Directories), f.EmptyHash)
	}
}

func TestCrossCheck(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// The same document, formatted differently, passes.
	same := write("same.json", " "+strings.ReplaceAll(string(lunarfsJSON), "\n", "\n  "))
	t.Setenv(EnvVar, same)
	if _, err := Load(); err != nil {
		t.Fatalf("identical vectors refused: %v", err)
	}
	// One changed value, a missing file and garbage fail, naming the variable.
	changed := write("changed.json", strings.Replace(string(lunarfsJSON), `"empty_hash"`, `"empty_hash_x"`, 1))
	for name, p := range map[string]string{
		"changed": changed,
		"missing": filepath.Join(dir, "absent.json"),
		"garbage": write("garbage.json", "{not json"),
	} {
		t.Setenv(EnvVar, p)
		if _, err := Load(); err == nil || !strings.Contains(err.Error(), EnvVar) {
			t.Errorf("%s: Load = %v, want an error naming $%s", name, err, EnvVar)
		}
	}
}

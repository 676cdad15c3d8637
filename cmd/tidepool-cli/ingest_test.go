package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// ingestTestCLI runs the tidepool CLI in-process against the state directory root.
func ingestTestCLI(t *testing.T, root string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := newRootCommand()
	var out, errb bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errb)
	cmd.SetArgs(append([]string{"--root", root}, args...))
	err = cmd.ExecuteContext(t.Context())
	return out.String(), errb.String(), err
}

func ingestTestWrite(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

var ingestRootRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// ingestLastRoot returns the last line of out, failing unless it is a root hash.
func ingestLastRoot(t *testing.T, out string) casstore.Hash {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	last := lines[len(lines)-1]
	if !ingestRootRE.MatchString(last) || !strings.HasSuffix(out, "\n") {
		t.Fatalf("stdout %q does not end with a root line", out)
	}
	h, err := casstore.ParseHash(last)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestIngestCommand(t *testing.T) {
	state := t.TempDir()
	src := filepath.Join(t.TempDir(), "src")
	ingestTestWrite(t, filepath.Join(src, "a.txt"), "hello")
	ingestTestWrite(t, filepath.Join(src, "b.txt"), "world")
	if err := os.Symlink("a.txt", filepath.Join(src, "link")); err != nil {
		t.Fatal(err)
	}

	out, errOut, err := ingestTestCLI(t, state, "ingest", "--lunar-strict", src)
	if err != nil {
		t.Fatal(err)
	}
	// flat-two-files from the LunarFS vectors: the symlink is dropped in strict mode.
	if got := ingestLastRoot(t, out); got.String() != "4b093b7ebd7dc129041900ab2c2942ffd771f6ed03f143592e8a06daf5d6b901" {
		t.Errorf("strict root %s, want LunarFS's", got)
	}
	if !strings.Contains(errOut, "ingested 2 files (10 B)") || strings.Count(errOut, "\n") != 1 {
		t.Errorf("stderr %q: want exactly the summary line (no progress bar off a terminal)", errOut)
	}

	out, _, err = ingestTestCLI(t, state, "ingest", src)
	if err != nil {
		t.Fatal(err)
	}
	def := ingestLastRoot(t, out)
	s, err := casstore.Open(filepath.Join(state, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	tree, err := s.ReadTree(def) // the objects landed in ROOT/cas
	if err != nil {
		t.Fatal(err)
	}
	if e, ok := tree.Lookup("link"); !ok || e.Mode != casstore.ModeSymlink {
		t.Errorf("default-mode root lacks the symlink entry: %+v", tree)
	}
}

func TestIngestCommandErrors(t *testing.T) {
	state := t.TempDir()
	missing := filepath.Join(t.TempDir(), "missing")
	out, _, err := ingestTestCLI(t, state, "ingest", missing)
	if err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("err = %v, want one naming %s", err, missing)
	}
	if out != "" {
		t.Errorf("stdout %q after a failure", out)
	}
	if _, _, err := ingestTestCLI(t, state, "ingest"); err == nil {
		t.Error("ingest without PATH succeeded")
	}
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 999: "999 B", 1000: "1.0 kB", 157_300_000: "157.3 MB", 2_500_000_000: "2.5 GB"} {
		if got := formatBytes(n); got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", n, got, want)
		}
	}
}

// ingestTestDir ingests dir straight through the package, for expected roots.
func ingestTestDir(t *testing.T, state, dir string) casstore.Hash {
	t.Helper()
	s, err := casstore.Open(filepath.Join(state, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	h, _, err := ingest.Dir(t.Context(), s, dir, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

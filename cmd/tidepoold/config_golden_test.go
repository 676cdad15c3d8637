package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite contrib/tidepoold.toml from --print-default-config")

// contribConfig is the shipped configuration file, which must stay the printed default.
var contribConfig = filepath.Join("..", "..", "contrib", "tidepoold.toml")

func TestGoldenContribConfig(t *testing.T) {
	want, err := defaultConfigTOML()
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		if err := os.WriteFile(contribConfig, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(contribConfig)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("contrib/tidepoold.toml differs from `tidepoold --print-default-config` (a config field was added, changed or "+
			"documented without regenerating it). Regenerate it with\n\tgo test ./cmd/tidepoold -run Golden -update\n"+
			"and review the diff. First difference: %s", firstDiff(got, want))
	}
}

// firstDiff quotes the first line where the file and the printed default part.
func firstDiff(got, want []byte) string {
	g, w := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
	line := func(ls []string, i int) string {
		if i < len(ls) {
			return strconv.Quote(ls[i])
		}
		return "<end of file>"
	}
	for i := 0; i < len(g) || i < len(w); i++ {
		if line(g, i) != line(w, i) {
			return fmt.Sprintf("line %d: file has %s, printed default has %s", i+1, line(g, i), line(w, i))
		}
	}
	return "none"
}

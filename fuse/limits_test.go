package fuse

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// TestViewLimits: a directory with more entries than Limits.MaxEntries, or nested
// deeper than MaxDepth, is refused (EIO) instead of listed; the rest of the view works.
func TestViewLimits(t *testing.T) {
	requireRoot(t)
	s := casstoretest.NewStore(t)
	blob := casstoretest.Put(t, s, "x")
	var wide []casstore.Entry
	for i := 0; i < 20; i++ {
		wide = append(wide, casstore.Entry{Mode: casstore.ModeFile, Name: fmt.Sprintf("f%02d", i), Hash: blob})
	}
	deep := casstore.EmptyHash
	for i := 0; i < 6; i++ {
		deep = casstoretest.Tree(t, s, casstore.Entry{Mode: casstore.ModeDir, Name: "d", Hash: deep})
	}
	root := casstoretest.Tree(t, s,
		casstore.Entry{Mode: casstore.ModeDir, Name: "wide", Hash: casstoretest.Tree(t, s, wide...)},
		casstore.Entry{Mode: casstore.ModeDir, Name: "deep", Hash: deep},
		casstore.Entry{Mode: casstore.ModeFile, Name: "ok.txt", Hash: blob})
	v := mount(t, s, root, Options{Limits: casstore.Limits{MaxEntries: 10, MaxDepth: 4}})
	if _, err := os.ReadDir(filepath.Join(v.Dir(), "wide")); err == nil {
		t.Error("listing a 20-entry directory with max_tree_entries 10 succeeded")
	}
	if _, err := os.Stat(filepath.Join(v.Dir(), "deep", strings.Repeat("d/", 4), "d")); err == nil {
		t.Error("a directory nested 5 deep was served with max_tree_depth 4")
	}
	if _, err := os.Stat(filepath.Join(v.Dir(), "deep", "d", "d")); err != nil {
		t.Errorf("a directory within the depth limit: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(v.Dir(), "ok.txt")); err != nil || string(b) != "x" {
		t.Errorf("ok.txt: %q, %v", b, err)
	}
}

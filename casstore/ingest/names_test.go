package ingest

import (
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// TestLossyName pins the conversion to Rust's to_string_lossy (what LunarFS uses): one
// U+FFFD per maximal ill-formed subsequence.
func TestLossyName(t *testing.T) {
	const r = "\uFFFD"
	cases := map[string]string{
		"plain":            "plain",
		"é":                "é",
		"n\xffx":           "n" + r + "x", // G12
		"n\xfex":           "n" + r + "x", // G12
		"n\xff\xfex":       "n" + r + r + "x",
		"\xe2\x82x":        r + "x",              // truncated 3-byte sequence: one replacement
		"\xe2\x82":         r,                    // truncated at the end
		"\xf0\x9f\x98":     r,                    // truncated 4-byte sequence
		"\xed\xa0\x80":     r + r + r,            // surrogate: ED then two stray continuations
		"\xc0\xaf":         r + r,                // overlong lead is never valid
		"\xe0\x80\x80":     r + r + r,            // E0 needs A0..BF next
		"\xf4\x90\x80\x80": r + r + r + r,        // above U+10FFFF
		"a\x80b":           "a" + r + "b",        // lone continuation byte
		"\xe2\x82\xac\xff": "€" + r,              // valid sequence then a bad byte
		"\xc3":             r,                    // lone lead at the end
		"\xc3(":            r + "(",              // lead followed by a non-continuation
		"\xf1\x80\x80x":    r + "x",              // 3 of 4 bytes, then ASCII
		"\xf1\x80\x80\xe9": r + r,                // 3 of 4 bytes, then a lone lead at the end
		"\xe9\xe9\xe9":     strings.Repeat(r, 3), // three lone leads
	}
	for in, want := range cases {
		if got := lossyName(in); got != want {
			t.Errorf("lossyName(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestCollidingNamesRejected: "n\xffx" and "n\xfex" both become "n\uFFFDx" (G12).
// LunarFS writes two identical entries; Tidepool refuses, in both modes, and the store
// is left exactly as it was.
func TestCollidingNamesRejected(t *testing.T) {
	for _, strict := range []bool{false, true} {
		dir := t.TempDir()
		writeFile(t, filepath.Join(dir, "ok.txt"), "fine", 0o644)
		writeFile(t, filepath.Join(dir, "sub", "n\xffx"), "one", 0o644)
		writeFile(t, filepath.Join(dir, "sub", "n\xfex"), "two", 0o644)
		s := casstoretest.NewStore(t)
		mustDir(t, s, t.TempDir(), Options{}) // something already in the store
		before := objects(t, s)

		_, _, err := Dir(t.Context(), s, dir, Options{LunarStrict: strict})
		if !errors.Is(err, ErrNameCollision) || !errdefs.IsInvalidArgument(err) {
			t.Fatalf("strict=%v: err = %v, want ErrNameCollision", strict, err)
		}
		for _, want := range []string{filepath.Join(dir, "sub"), `"n\xfex"`, `"n\xffx"`} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not mention %s", err, want)
			}
		}
		if after := objects(t, s); !slices.Equal(before, after) {
			t.Errorf("store changed by a failed ingest: %d objects before, %d after", len(before), len(after))
		}
	}
}

// TestCollisionIgnoresSkippedEntries: only kept entries can collide; a FIFO that would
// collide is skipped first, as LunarFS skips it.
func TestCollisionIgnoresSkippedEntries(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "n\xffx"), "one", 0o644)
	mkfifo(t, filepath.Join(dir, "n\xfex"))
	s := casstoretest.NewStore(t)
	root := mustDir(t, s, dir, Options{})
	tree, err := s.ReadTree(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree) != 1 || tree[0].Name != "n\uFFFDx" {
		t.Fatalf("tree = %+v, want the single entry n\\uFFFDx", tree)
	}
}

func TestSingleNonUTF8Name(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "n\xffx"), "content", 0o600)
	mkdirs(t, filepath.Join(dir, "d\xfe"))
	s := casstoretest.NewStore(t)
	for _, strict := range []bool{false, true} {
		root := mustDir(t, s, dir, Options{LunarStrict: strict})
		tree, err := s.ReadTree(root)
		if err != nil {
			t.Fatal(err)
		}
		want := casstore.Tree{
			{Mode: casstore.ModeDir, Name: "d\uFFFD", Hash: casstore.EmptyHash},
			{Mode: casstore.ModeFile, Name: "n\uFFFDx", Hash: casstore.Sum([]byte("content"))},
		}
		if !tree.Equal(want) {
			t.Fatalf("strict=%v: tree = %+v, want %+v", strict, tree, want)
		}
	}
}

func TestValidatePrefix(t *testing.T) {
	for _, ok := range []string{"", ".", "app", "srv/api", "a.b/c-d"} {
		if err := ValidatePrefix(ok); err != nil {
			t.Errorf("ValidatePrefix(%q) = %v", ok, err)
		}
	}
	for bad, want := range map[string]string{
		"/app":     "relative",
		"../app":   `".."`,
		"app/..":   "not clean",
		"app/../x": "not clean",
		"app/":     "not clean",
		"./app":    "not clean",
		"a//b":     "not clean",
		"..":       `".."`,
	} {
		err := ValidatePrefix(bad)
		if err == nil || !strings.Contains(err.Error(), want) || !errdefs.IsInvalidArgument(err) {
			t.Errorf("ValidatePrefix(%q) = %v, want an invalid-argument error mentioning %s", bad, err, want)
		}
	}
}

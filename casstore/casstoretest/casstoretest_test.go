package casstoretest

import (
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
)

// TestBuildMatchesHandBuiltTree checks that Build lays out paths, modes and empty
// directories as the tests that use it assume: the same root as building each tree
// by hand.
func TestBuildMatchesHandBuiltTree(t *testing.T) {
	s := NewStore(t)
	got := Build(t, s, map[string]Leaf{
		"a":         File("1"),
		"d/run":     Exec("2"),
		"d/sub/l":   Link("../a"),
		"d/sub/e":   EmptyDir(),
		"top-empty": EmptyDir(),
	})
	empty := Tree(t, s)
	sub := Tree(t, s,
		casstore.Entry{Mode: casstore.ModeSymlink, Name: "l", Hash: Put(t, s, "../a")},
		casstore.Entry{Mode: casstore.ModeDir, Name: "e", Hash: empty},
	)
	d := Tree(t, s,
		casstore.Entry{Mode: casstore.ModeExec, Name: "run", Hash: Put(t, s, "2")},
		casstore.Entry{Mode: casstore.ModeDir, Name: "sub", Hash: sub},
	)
	want := Tree(t, s,
		casstore.Entry{Mode: casstore.ModeFile, Name: "a", Hash: Put(t, s, "1")},
		casstore.Entry{Mode: casstore.ModeDir, Name: "d", Hash: d},
		casstore.Entry{Mode: casstore.ModeDir, Name: "top-empty", Hash: empty},
	)
	if got != want {
		t.Fatalf("Build gave %s, hand-built tree is %s", got, want)
	}
	if h := Build(t, s, Files(map[string]string{"a": "1"})); h != Tree(t, s, casstore.Entry{Mode: casstore.ModeFile, Name: "a", Hash: Put(t, s, "1")}) {
		t.Fatalf("Files: got %s", h)
	}
	if h := Build(t, s, nil); h != casstore.EmptyHash {
		t.Fatalf("empty Build gave %s, want the empty tree %s", h, casstore.EmptyHash)
	}
}

// TestRawTreeIsTheTreeFormat checks that RawTree writes the codec's bytes for a valid
// tree, so the invalid trees tests make with it differ only where they mean to.
func TestRawTreeIsTheTreeFormat(t *testing.T) {
	s := NewStore(t)
	ents := []casstore.Entry{
		{Mode: casstore.ModeFile, Name: "a", Hash: casstore.Sum([]byte("x"))},
		{Mode: casstore.ModeDir, Name: "b", Hash: casstore.EmptyHash},
	}
	if raw, codec := RawTree(t, s, ents...), Tree(t, s, ents...); raw != codec {
		t.Fatalf("RawTree gave %s, the codec %s", raw, codec)
	}
}

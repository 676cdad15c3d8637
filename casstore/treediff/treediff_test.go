package treediff

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// Short names for the test trees the cases below are written in.
type leaf = casstoretest.Leaf

var (
	file     = casstoretest.File
	exec     = casstoretest.Exec
	link     = casstoretest.Link
	emptyDir = casstoretest.EmptyDir
	build    = casstoretest.Build
)

// counting wraps a store and records every tree it is asked to read.
type counting struct {
	s    *casstore.Store
	mu   sync.Mutex
	read map[casstore.Hash]int
}

func (c *counting) ReadTree(h casstore.Hash) (casstore.Tree, error) {
	c.mu.Lock()
	if c.read == nil {
		c.read = map[casstore.Hash]int{}
	}
	c.read[h]++
	c.mu.Unlock()
	return c.s.ReadTree(h)
}

func (c *counting) total() int {
	n := 0
	for _, v := range c.read {
		n += v
	}
	return n
}

func lines(cs []Change) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.String()
	}
	return out
}

func mustDiff(t *testing.T, r TreeReader, a, b casstore.Hash) []Change {
	t.Helper()
	cs, err := Diff(context.Background(), r, a, b)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func TestDiffCases(t *testing.T) {
	s := casstoretest.NewStore(t)
	big := map[string]leaf{}
	for i := 0; i < 50; i++ {
		big[fmt.Sprintf("vendor/pkg%02d/file.go", i)] = file(fmt.Sprint(i))
	}
	with := func(m map[string]leaf, extra map[string]leaf, drop ...string) map[string]leaf {
		out := map[string]leaf{}
		for k, v := range m {
			out[k] = v
		}
		for _, k := range drop {
			delete(out, k)
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	cases := []struct {
		name string
		a, b map[string]leaf
		want []string
	}{
		{"identical", big, big, nil},
		{"modify", with(big, map[string]leaf{"a.txt": file("1")}), with(big, map[string]leaf{"a.txt": file("2")}), []string{"M a.txt"}},
		{"add and delete", with(big, map[string]leaf{"old": file("x")}), with(big, map[string]leaf{"new": file("x")}), []string{"A new", "D old"}},
		{"chmod +x", map[string]leaf{"run.sh": file("echo")}, map[string]leaf{"run.sh": exec("echo")}, []string{"T run.sh"}},
		{"chmod and edit", map[string]leaf{"run.sh": file("echo")}, map[string]leaf{"run.sh": exec("echo hi")}, []string{"T run.sh"}},
		{"file to symlink", map[string]leaf{"l": file("target")}, map[string]leaf{"l": link("target")}, []string{"T l"}},
		{"symlink retarget", map[string]leaf{"l": link("a")}, map[string]leaf{"l": link("b")}, []string{"M l"}},
		// G14 of the LunarFS spec.
		{"file to dir", map[string]leaf{"thing": file("x")}, map[string]leaf{"thing/inner.txt": file("y")}, []string{"D thing", "A thing/inner.txt"}},
		{"dir to file", map[string]leaf{"thing/child.txt": file("y")}, map[string]leaf{"thing": file("x")}, []string{"A thing", "D thing/child.txt"}},
		{"mkdir", map[string]leaf{"a": file("1")}, map[string]leaf{"a": file("1"), "x": emptyDir()}, []string{"A x"}},
		{"rmdir", map[string]leaf{"x": emptyDir()}, nil, []string{"D x"}},
		{"fill empty dir", map[string]leaf{"x": emptyDir()}, map[string]leaf{"x/y": file("1")}, []string{"A x/y"}},
		// Same hash H(""), different modes: not skipped.
		{"empty file to empty dir", map[string]leaf{"e": file("")}, map[string]leaf{"e": emptyDir()}, []string{"D e", "A e"}},
		{"empty dir to empty file", map[string]leaf{"e": emptyDir()}, map[string]leaf{"e": file("")}, []string{"D e", "A e"}},
		{"recursive add", nil, map[string]leaf{"d/a/1": file("1"), "d/b": link("1"), "d/c": emptyDir()}, []string{"A d/a/1", "A d/b", "A d/c"}},
		{"recursive delete", map[string]leaf{"d/a/1": file("1"), "d/b": link("1"), "d/c": emptyDir()}, map[string]leaf{"e": file("")}, []string{"D d/a/1", "D d/b", "D d/c", "A e"}},
		// Byte order of paths, not tree order: "a-b" < "a/x" because '-' < '/'.
		{"path byte order", map[string]leaf{"a/x": file("1"), "a-b": file("1")}, map[string]leaf{"a/x": file("2"), "a-b": file("2")}, []string{"M a-b", "M a/x"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a, b := build(t, s, tc.a), build(t, s, tc.b)
			got := lines(mustDiff(t, s, a, b))
			if len(got) != len(tc.want) || len(got) > 0 && !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("diff:\n got %q\nwant %q", got, tc.want)
			}
		})
	}
}

// TestDiffPrunesEqualSubtrees proves the O(changed) claim: a change deep in one
// directory reads exactly the trees on its path, and a large unchanged sibling is
// never opened.
func TestDiffPrunesEqualSubtrees(t *testing.T) {
	s := casstoretest.NewStore(t)
	base := map[string]leaf{"src/a/b/c/main.go": file("v1"), "src/a/b/other.go": file("x")}
	for i := 0; i < 200; i++ {
		base[fmt.Sprintf("vendor/m%03d/n/file.go", i)] = file(fmt.Sprint(i))
	}
	next := map[string]leaf{}
	for k, v := range base {
		next[k] = v
	}
	next["src/a/b/c/main.go"] = file("v2")
	a, b := build(t, s, base), build(t, s, next)

	c := &counting{s: s}
	if cs := mustDiff(t, c, a, a); len(cs) != 0 || c.total() != 0 {
		t.Fatalf("equal roots: %d changes, %d tree reads; want 0, 0", len(cs), c.total())
	}
	got := lines(mustDiff(t, c, a, b))
	if want := []string{"M src/a/b/c/main.go"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
	// root, src, src/a, src/a/b, src/a/b/c on both sides.
	if c.total() != 10 {
		t.Fatalf("read %d trees, want 10 (the five on the changed path, on each side)", c.total())
	}
	rootTree, err := s.ReadTree(a)
	if err != nil {
		t.Fatal(err)
	}
	vendor, ok := rootTree.Lookup("vendor")
	if !ok {
		t.Fatal("no vendor entry")
	}
	if c.read[vendor.Hash] != 0 {
		t.Fatal("the unchanged vendor subtree was opened")
	}
}

func TestDiffChangeFields(t *testing.T) {
	s := casstoretest.NewStore(t)
	a := build(t, s, map[string]leaf{"m": file("1"), "t": file("x"), "d": file("gone")})
	b := build(t, s, map[string]leaf{"m": file("2"), "t": exec("x"), "n": link("m")})
	cs := mustDiff(t, s, a, b)
	h := func(x string) casstore.Hash { return casstore.Sum([]byte(x)) }
	want := []Change{
		{Status: Deleted, Path: "d", OldMode: casstore.ModeFile, OldHash: h("gone")},
		{Status: Modified, Path: "m", OldMode: casstore.ModeFile, NewMode: casstore.ModeFile, OldHash: h("1"), NewHash: h("2")},
		{Status: Added, Path: "n", NewMode: casstore.ModeSymlink, NewHash: h("m")},
		{Status: TypeMode, Path: "t", OldMode: casstore.ModeFile, NewMode: casstore.ModeExec, OldHash: h("x"), NewHash: h("x")},
	}
	if !reflect.DeepEqual(cs, want) {
		t.Fatalf("got %+v\nwant %+v", cs, want)
	}

	raw, err := json.Marshal(cs)
	if err != nil {
		t.Fatal(err)
	}
	var objs []map[string]any
	if err := json.Unmarshal(raw, &objs); err != nil {
		t.Fatal(err)
	}
	wantJSON := []map[string]any{
		{"status": "D", "path": "d", "old_mode": "100644", "new_mode": nil, "old_hash": h("gone").String(), "new_hash": nil},
		{"status": "M", "path": "m", "old_mode": "100644", "new_mode": "100644", "old_hash": h("1").String(), "new_hash": h("2").String()},
		{"status": "A", "path": "n", "old_mode": nil, "new_mode": "120000", "old_hash": nil, "new_hash": h("m").String()},
		{"status": "T", "path": "t", "old_mode": "100644", "new_mode": "100755", "old_hash": h("x").String(), "new_hash": h("x").String()},
	}
	if !reflect.DeepEqual(objs, wantJSON) {
		t.Fatalf("json:\n got %s\nwant %v", raw, wantJSON)
	}
}

func TestDiffMissingTreeNamesPath(t *testing.T) {
	s := casstoretest.NewStore(t)
	a := build(t, s, map[string]leaf{"keep": file("k"), "sub/x": file("1")})
	b := build(t, s, map[string]leaf{"keep": file("k"), "sub/x": file("2")})
	tb, err := s.ReadTree(b)
	if err != nil {
		t.Fatal(err)
	}
	sub, _ := tb.Lookup("sub")
	if err := os.Remove(s.Path(sub.Hash)); err != nil {
		t.Fatal(err)
	}
	_, err = Diff(context.Background(), s, a, b)
	if !errdefs.IsNotFound(err) {
		t.Fatalf("want a not-found error, got %v", err)
	}
	if !strings.Contains(err.Error(), `"sub"`) || !strings.Contains(err.Error(), sub.Hash.String()) {
		t.Fatalf("error does not name the path and the tree: %v", err)
	}
}

func TestDiffHonoursCancel(t *testing.T) {
	s := casstoretest.NewStore(t)
	a := build(t, s, map[string]leaf{"x/y": file("1")})
	b := build(t, s, map[string]leaf{"x/y": file("2")})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Diff(ctx, s, a, b); !errors.Is(err, context.Canceled) {
		t.Fatalf("want context.Canceled, got %v", err)
	}
}

// TestDiffMatchesNaive compares Diff with a brute-force diff of the fully flattened
// trees on random pairs that share structure, in the spirit of LunarFS's semantics.
func TestDiffMatchesNaive(t *testing.T) {
	s := casstoretest.NewStore(t)
	seed := rand.Int63()
	rng := rand.New(rand.NewSource(seed))
	t.Logf("seed %d", seed)
	for iter := 0; iter < 300; iter++ {
		a := randomTree(rng)
		b := mutate(rng, a)
		ha, hb := build(t, s, a), build(t, s, b)
		c := &counting{s: s}
		got := lines(mustDiff(t, c, ha, hb))
		want := naive(a, b)
		if len(got) != len(want) || len(got) > 0 && !reflect.DeepEqual(got, want) {
			t.Fatalf("seed %d iteration %d:\na=%v\nb=%v\n got %q\nwant %q", seed, iter, a, b, got, want)
		}
		if (len(want) == 0) != (ha == hb) {
			t.Fatalf("seed %d iteration %d: empty diff %v but roots equal %v", seed, iter, len(want) == 0, ha == hb)
		}
	}
}

var names = []string{"a", "a-b", "b", "é"}
var datas = []string{"", "1", "2"}

func randomLeaf(rng *rand.Rand) leaf {
	modes := []casstore.Mode{casstore.ModeFile, casstore.ModeExec, casstore.ModeSymlink, casstore.ModeDir}
	m := modes[rng.Intn(len(modes))]
	if m == casstore.ModeDir {
		return emptyDir()
	}
	return leaf{Mode: m, Data: datas[rng.Intn(len(datas))]}
}

func randomPath(rng *rand.Rand) string {
	depth := 1 + rng.Intn(3)
	parts := make([]string, depth)
	for i := range parts {
		parts[i] = names[rng.Intn(len(names))]
	}
	return strings.Join(parts, "/")
}

// put adds a leaf and removes whatever it conflicts with, as a file system would.
func put(m map[string]leaf, p string, l leaf) {
	for k := range m {
		if strings.HasPrefix(k, p+"/") || strings.HasPrefix(p, k+"/") {
			delete(m, k)
		}
	}
	m[p] = l
}

func randomTree(rng *rand.Rand) map[string]leaf {
	m := map[string]leaf{}
	for i := rng.Intn(12); i > 0; i-- {
		put(m, randomPath(rng), randomLeaf(rng))
	}
	return m
}

func mutate(rng *rand.Rand, a map[string]leaf) map[string]leaf {
	b := map[string]leaf{}
	for k, v := range a {
		b[k] = v
	}
	keys := make([]string, 0, len(b))
	for k := range b {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i := rng.Intn(4); i > 0; i-- {
		switch op := rng.Intn(4); {
		case op == 0 && len(keys) > 0:
			delete(b, keys[rng.Intn(len(keys))])
		case op == 1 && len(keys) > 0:
			k := keys[rng.Intn(len(keys))]
			put(b, k, randomLeaf(rng))
		case op == 2 && len(keys) > 0:
			// Remove a whole directory.
			k := keys[rng.Intn(len(keys))]
			if i := strings.IndexByte(k, '/'); i > 0 {
				for p := range b {
					if strings.HasPrefix(p, k[:i]+"/") {
						delete(b, p)
					}
				}
			}
		default:
			put(b, randomPath(rng), randomLeaf(rng))
		}
	}
	return b
}

func naive(a, b map[string]leaf) []string {
	dirs := func(m map[string]leaf) map[string]bool {
		d := map[string]bool{}
		for p := range m {
			for i := 0; i < len(p); i++ {
				if p[i] == '/' {
					d[p[:i]] = true
				}
			}
		}
		return d
	}
	da, db := dirs(a), dirs(b)
	type ch struct {
		path string
		st   byte
	}
	var out []ch
	all := map[string]bool{}
	for p := range a {
		all[p] = true
	}
	for p := range b {
		all[p] = true
	}
	for p := range all {
		la, ina := a[p]
		lb, inb := b[p]
		switch {
		case ina && inb:
			if la.Mode == lb.Mode && la.Data == lb.Data {
				continue
			}
			if la.Mode == casstore.ModeDir || lb.Mode == casstore.ModeDir {
				out = append(out, ch{p, Deleted}, ch{p, Added})
			} else if la.Mode == lb.Mode {
				out = append(out, ch{p, Modified})
			} else {
				out = append(out, ch{p, TypeMode})
			}
		case ina:
			if !(la.Mode == casstore.ModeDir && db[p]) {
				out = append(out, ch{p, Deleted})
			}
		case inb:
			if !(lb.Mode == casstore.ModeDir && da[p]) {
				out = append(out, ch{p, Added})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].path != out[j].path {
			return out[i].path < out[j].path
		}
		return rank(out[i].st) < rank(out[j].st)
	})
	var res []string
	for _, c := range out {
		res = append(res, string(c.st)+" "+c.path)
	}
	return res
}

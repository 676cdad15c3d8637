package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
)

// binary is the tidepool CLI built once for all tests of this package.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tidepool-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "tidepool")
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", binary, ".")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building tidepool: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// env is one Tidepool root in a temp dir, driven through the binary.
type env struct {
	t     *testing.T
	root  string
	store *casstore.Store
}

func newEnv(t *testing.T) *env {
	t.Helper()
	root := t.TempDir()
	s, err := casstore.Open(filepath.Join(root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, root: root, store: s}
}

func (e *env) run(args ...string) (stdout, stderr string, code int) {
	e.t.Helper()
	cmd := exec.Command(binary, append([]string{"--root", e.root}, args...)...)
	var o, se bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &se
	err := cmd.Run()
	if err != nil {
		ee, ok := err.(*exec.ExitError)
		if !ok {
			e.t.Fatalf("run %v: %v", args, err)
		}
		code = ee.ExitCode()
	}
	return o.String(), se.String(), code
}

// ok runs a command that must succeed and returns its stdout.
func (e *env) ok(args ...string) string {
	e.t.Helper()
	out, errOut, code := e.run(args...)
	if code != 0 {
		e.t.Fatalf("tidepool %s: exit %d\n%s", strings.Join(args, " "), code, errOut)
	}
	return out
}

// fail runs a command that must fail the CLI way: non-zero exit, one line on stderr
// starting "tidepool: ", and nothing on stdout. It returns the error line.
func (e *env) fail(args ...string) string {
	e.t.Helper()
	out, errOut, code := e.run(args...)
	if code == 0 {
		e.t.Fatalf("tidepool %s succeeded, want failure; stdout:\n%s", strings.Join(args, " "), out)
	}
	if out != "" {
		e.t.Errorf("tidepool %s: failure printed on stdout: %q", strings.Join(args, " "), out)
	}
	if !strings.HasPrefix(errOut, "tidepool: ") || strings.Count(errOut, "\n") != 1 || !strings.HasSuffix(errOut, "\n") {
		e.t.Errorf("tidepool %s: stderr is not one error line: %q", strings.Join(args, " "), errOut)
	}
	return errOut
}

type leaf struct {
	mode casstore.Mode
	data string
}

func file(s string) leaf { return leaf{casstore.ModeFile, s} }

// tree stores a tree given as path -> leaf (a ModeDir leaf is an empty directory).
func (e *env) tree(leaves map[string]leaf) casstore.Hash {
	e.t.Helper()
	b, err := e.store.Begin()
	if err != nil {
		e.t.Fatal(err)
	}
	defer b.Abort()
	var write func(prefix string) casstore.Hash
	write = func(prefix string) casstore.Hash {
		children := map[string]bool{}
		var ents []casstore.Entry
		for p, l := range leaves {
			if !strings.HasPrefix(p, prefix) {
				continue
			}
			rest := p[len(prefix):]
			if i := strings.IndexByte(rest, '/'); i >= 0 {
				children[rest[:i]] = true
				continue
			}
			h := casstore.EmptyHash
			if l.mode != casstore.ModeDir {
				if h, err = b.PutBytes([]byte(l.data)); err != nil {
					e.t.Fatal(err)
				}
			}
			ents = append(ents, casstore.Entry{Mode: l.mode, Name: rest, Hash: h})
		}
		for name := range children {
			ents = append(ents, casstore.Entry{Mode: casstore.ModeDir, Name: name, Hash: write(prefix + name + "/")})
		}
		h, err := b.WriteTree(ents)
		if err != nil {
			e.t.Fatal(err)
		}
		return h
	}
	h := write("")
	if err := b.Commit(); err != nil {
		e.t.Fatal(err)
	}
	return h
}

// lookup returns the entry at path inside root, read directly from the store.
func (e *env) lookup(root casstore.Hash, path string) casstore.Entry {
	e.t.Helper()
	ent := casstore.Entry{Mode: casstore.ModeDir, Hash: root}
	for _, name := range strings.Split(path, "/") {
		t, err := e.store.ReadTree(ent.Hash)
		if err != nil {
			e.t.Fatal(err)
		}
		var ok bool
		if ent, ok = t.Lookup(name); !ok {
			e.t.Fatalf("no %s", path)
		}
	}
	return ent
}

// snapshot records every file of the store with a hash of its content, to prove a
// failed command changed nothing.
func (e *env) snapshot() map[string]casstore.Hash {
	e.t.Helper()
	out := map[string]casstore.Hash{}
	err := filepath.Walk(e.store.Root(), func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		out[p] = casstore.Sum(b)
		return err
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

func sample() map[string]leaf {
	return map[string]leaf{
		"README.md":    file("# demo\n"),
		"src/main.go":  file("package main\n"),
		"src/lib/x.go": file("package lib\n"),
		"bin/run":      {casstore.ModeExec, "#!/bin/sh\n"},
		"link":         {casstore.ModeSymlink, "src/main.go"},
		"empty":        {mode: casstore.ModeDir},
		"zero":         file(""),
	}
}

func TestLsTree(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	line := func(p string) string {
		ent := e.lookup(root, p)
		return fmt.Sprintf("%s %s %s", ent.Mode, ent.Hash, p)
	}
	lines := func(ps ...string) string {
		var b strings.Builder
		for _, p := range ps {
			b.WriteString(line(p) + "\n")
		}
		return b.String()
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{root.String()}, lines("README.md", "bin", "empty", "link", "src", "zero")},
		{[]string{"-r", root.String()}, lines("README.md", "bin", "bin/run", "empty", "link", "src", "src/lib", "src/lib/x.go", "src/main.go", "zero")},
		{[]string{root.String(), "src"}, lines("src/lib", "src/main.go")},
		{[]string{root.String(), "src/"}, lines("src/lib", "src/main.go")},
		{[]string{"-r", root.String(), "src"}, lines("src/lib", "src/lib/x.go", "src/main.go")},
		{[]string{root.String(), "bin/run"}, lines("bin/run")},
	} {
		if got := e.ok(append([]string{"ls-tree"}, tc.args...)...); got != tc.want {
			t.Errorf("ls-tree %v:\n got %q\nwant %q", tc.args, got, tc.want)
		}
	}
	if !strings.HasPrefix(line("bin/run"), "100755 ") || !strings.HasPrefix(line("link"), "120000 ") || !strings.HasPrefix(line("src"), "040000 ") {
		t.Fatal("modes are not six octal digits")
	}
	e.fail("ls-tree", root.String(), "nope")
	e.fail("ls-tree", root.String(), "README.md/x")
	e.fail("ls-tree", root.String(), "../etc")
}

func TestCat(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	for p, want := range map[string]string{"src/main.go": "package main\n", "bin/run": "#!/bin/sh\n", "link": "src/main.go", "zero": ""} {
		if got := e.ok("cat", root.String(), p); got != want {
			t.Errorf("cat %s = %q, want %q", p, got, want)
		}
	}
	if msg := e.fail("cat", root.String(), "src"); !strings.Contains(msg, "is a directory") {
		t.Errorf("cat of a directory: %s", msg)
	}
	e.fail("cat", root.String(), "nope")
	e.fail("cat", root.String())
}

func TestCheckout(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	dst := filepath.Join(t.TempDir(), "out")
	e.ok("checkout", root.String(), dst)
	for p, want := range map[string]string{"src/main.go": "package main\n", "bin/run": "#!/bin/sh\n", "zero": ""} {
		if got, err := os.ReadFile(filepath.Join(dst, p)); err != nil || string(got) != want {
			t.Errorf("%s = %q, %v", p, got, err)
		}
	}
	if fi, err := os.Stat(filepath.Join(dst, "bin/run")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("bin/run mode: %v, %v", fi.Mode(), err)
	}
	if target, err := os.Readlink(filepath.Join(dst, "link")); err != nil || target != "src/main.go" {
		t.Errorf("link: %q, %v", target, err)
	}
	if fi, err := os.Stat(filepath.Join(dst, "empty")); err != nil || !fi.IsDir() {
		t.Errorf("empty dir: %v", err)
	}

	pre := t.TempDir()
	e.ok("checkout", root.String(), pre, "--prefix", "srv/app")
	if got, err := os.ReadFile(filepath.Join(pre, "srv/app/README.md")); err != nil || string(got) != "# demo\n" {
		t.Errorf("prefix checkout: %q, %v", got, err)
	}
	// Neither a non-empty directory nor a bad prefix is touched.
	before, _ := os.ReadDir(pre)
	e.fail("checkout", root.String(), pre)
	e.fail("checkout", root.String(), filepath.Join(pre, "new"), "--prefix", "../escape")
	if after, _ := os.ReadDir(pre); len(after) != len(before) {
		t.Fatalf("failed checkouts changed %s", pre)
	}
}

func TestForkLifecycle(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	id := strings.TrimSpace(e.ok("fork", root.String(), "--label", "web", "--ttl", "1h", "--label-kv", "team=infra", "--label-kv", "env=dev"))
	if len(id) != 16 {
		t.Fatalf("fork printed %q, want a 16-hex id", id)
	}
	// The fork resolves by id and by label wherever a root is accepted.
	for _, ref := range []string{id, "web"} {
		if got := e.ok("cat", ref, "src/main.go"); got != "package main\n" {
			t.Fatalf("cat via %s: %q", ref, got)
		}
	}
	child := strings.TrimSpace(e.ok("fork", "web"))

	var list []map[string]any
	if err := json.Unmarshal([]byte(e.ok("forks", "--json")), &list); err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 {
		t.Fatalf("forks --json: %v", list)
	}
	f := list[0]
	for k, want := range map[string]any{"id": id, "label": "web", "base": root.String(), "root": root.String(), "ttl": "1h0m0s"} {
		if f[k] != want {
			t.Errorf("forks --json %s = %v, want %v", k, f[k], want)
		}
	}
	if _, ok := f["created"].(string); !ok {
		t.Errorf("forks --json has no created time: %v", f)
	}
	if labels, _ := f["labels"].(map[string]any); labels["team"] != "infra" || labels["env"] != "dev" {
		t.Errorf("labels %v", f["labels"])
	}
	if list[1]["id"] != child || list[1]["base"] != root.String() {
		t.Errorf("fork of a fork: %v", list[1])
	}

	table := strings.Split(strings.TrimSpace(e.ok("forks")), "\n")
	if len(table) != 3 || !reflect.DeepEqual(strings.Fields(table[0]), []string{"ID", "LABEL", "ROOT", "CREATED", "TTL"}) {
		t.Fatalf("table:\n%s", strings.Join(table, "\n"))
	}
	if row := strings.Fields(table[1]); len(row) != 5 || row[0] != id || row[1] != "web" || row[2] != root.Short() || row[4] != "1h0m0s" {
		t.Fatalf("row %q", table[1])
	}

	// rm resolves every argument first: one unknown fork removes nothing.
	e.fail("forks", "rm", child, "nosuchfork")
	if n := strings.Count(e.ok("forks"), "\n"); n != 3 {
		t.Fatalf("a failed rm removed forks")
	}
	e.ok("forks", "rm", "web", child)
	if got := strings.TrimSpace(e.ok("forks", "--json")); got != "[]" {
		t.Fatalf("after rm: %s", got)
	}
	e.fail("cat", "web", "src/main.go")

	// The empty tree needs no object to be forked.
	e.ok("fork", casstore.EmptyHash.String())
}

func TestForkRefusesBadInput(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	absent := casstore.Sum([]byte("not stored"))
	for _, args := range [][]string{
		{"fork", absent.String()},
		{"fork", root.String(), "--label", "0123456789abcdef"},
		{"fork", root.String(), "--label", strings.Repeat("a", 64)},
		{"fork", root.String(), "--label-kv", "novalue"},
		{"fork", root.String(), "--label-kv", "=x"},
		{"fork", root.String(), "--label-kv", "k=1", "--label-kv", "k=2"},
		{"fork", root.String(), "--ttl", "-1h"},
		{"fork", root.String(), "--ttl", "soon"},
	} {
		e.fail(args...)
	}
	if got := strings.TrimSpace(e.ok("forks", "--json")); got != "[]" {
		t.Fatalf("refused forks were recorded: %s", got)
	}
}

func TestDiff(t *testing.T) {
	e := newEnv(t)
	a := e.tree(sample())
	next := sample()
	next["src/main.go"] = file("package main // v2\n")
	next["bin/run"] = file("#!/bin/sh\n") // chmod -x
	delete(next, "README.md")
	next["new/dir/f"] = file("new")
	b := e.tree(next)
	e.ok("fork", a.String(), "--label", "before")

	want := "D README.md\nT bin/run\nA new/dir/f\nM src/main.go\n"
	if got := e.ok("diff", "before", b.String()); got != want {
		t.Fatalf("diff:\n got %q\nwant %q", got, want)
	}
	if got := e.ok("diff", a.String(), a.String()); got != "" {
		t.Fatalf("diff of equal roots: %q", got)
	}
	var changes []map[string]any
	if err := json.Unmarshal([]byte(e.ok("diff", "--json", a.String(), b.String())), &changes); err != nil {
		t.Fatal(err)
	}
	if len(changes) != 4 {
		t.Fatalf("json: %v", changes)
	}
	want0 := map[string]any{"status": "D", "path": "README.md", "old_mode": "100644", "new_mode": nil,
		"old_hash": casstore.Sum([]byte("# demo\n")).String(), "new_hash": nil}
	if !reflect.DeepEqual(changes[0], want0) {
		t.Fatalf("json[0] = %v, want %v", changes[0], want0)
	}
	if got := strings.TrimSpace(e.ok("diff", "--json", a.String(), a.String())); got != "[]" {
		t.Fatalf("json of no changes: %s", got)
	}
}

func TestGC(t *testing.T) {
	e := newEnv(t)
	live := e.tree(sample())
	e.ok("fork", live.String(), "--label", "keep")
	dead := e.tree(map[string]leaf{"old/file": file("garbage 1"), "other": file("garbage 2")})
	before := e.snapshot()

	out := e.ok("gc", "--grace", "0", "--dry-run")
	if !strings.Contains(out, "would sweep 4 objects") {
		t.Fatalf("dry run:\n%s", out)
	}
	if after := e.snapshot(); !reflect.DeepEqual(after, before) {
		t.Fatal("a dry run changed the store")
	}
	// With the default grace, objects written moments ago stay.
	if out := e.ok("gc"); !strings.Contains(out, "swept 0 objects") || !strings.Contains(out, "kept 4 unreachable") {
		t.Fatalf("gc with grace:\n%s", out)
	}
	if out := e.ok("gc", "--grace", "0"); !strings.Contains(out, "swept 4 objects") {
		t.Fatalf("gc:\n%s", out)
	}
	if ok, _ := e.store.Has(dead); ok {
		t.Fatal("unreachable root survived")
	}
	// Everything the fork reaches is intact.
	if got := e.ok("cat", "keep", "src/lib/x.go"); got != "package lib\n" {
		t.Fatalf("after gc: %q", got)
	}
	e.ok("fsck")
	e.fail("gc", "--grace", "-1s")
}

func TestFsck(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	e.ok("fork", root.String())
	if out := e.ok("fsck"); !strings.HasPrefix(out, "checked 10 objects") {
		t.Fatalf("fsck:\n%s", out)
	}
	blob := e.lookup(root, "src/main.go").Hash
	if err := os.WriteFile(e.store.Path(blob), []byte("tampered"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := e.run("fsck")
	if code == 0 || !strings.Contains(out, "corrupt "+blob.String()) || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, "1 corrupt") {
		t.Fatalf("fsck of a corrupt store: exit %d\n%s%s", code, out, errOut)
	}
	if _, err := os.Stat(e.store.Path(blob)); err != nil {
		t.Fatal("fsck without --quarantine moved the object")
	}
	out, _, code = e.run("fsck", "--quarantine")
	if code == 0 || !strings.Contains(out, "moved to "+filepath.Join(e.store.Root(), ".quarantine")) {
		t.Fatalf("fsck --quarantine: exit %d\n%s", code, out)
	}
	// Quarantined, the object is now missing, and fsck still fails until it is restored.
	out, errOut, code = e.run("fsck")
	if code == 0 || !strings.Contains(out, "missing blob "+blob.String()) || !strings.Contains(errOut, "1 missing") {
		t.Fatalf("fsck after quarantine: exit %d\n%s%s", code, out, errOut)
	}
	if _, err := e.store.PutBytes([]byte("package main\n")); err != nil {
		t.Fatal(err)
	}
	e.ok("fsck")
}

// TestBadInputLeavesStoreUnchanged: malformed hashes, unknown forks, missing and
// corrupt objects fail with one line on stderr, print nothing on stdout and leave the
// store as it was.
func TestBadInputLeavesStoreUnchanged(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample())
	other := e.tree(map[string]leaf{"src/main.go": file("changed"), "src/lib/x.go": file("package lib\n")})
	// Make src/lib missing in a copy of the tree by deleting a blob and a tree that
	// only brokenRoot reaches, and corrupt one blob of the sample.
	broken := e.tree(map[string]leaf{"gone.txt": file("will be deleted"), "deep/sub/f": file("deep"), "bad.txt": file("will rot")})
	for _, p := range []string{"gone.txt", "deep/sub"} {
		if err := os.Remove(e.store.Path(e.lookup(broken, p).Hash)); err != nil {
			t.Fatal(err)
		}
	}
	rot := e.lookup(broken, "bad.txt").Hash
	if err := os.WriteFile(e.store.Path(rot), []byte("rotten bytes"), 0o644); err != nil {
		t.Fatal(err)
	}
	upper := strings.ToUpper(root.String())
	nonHex := strings.Repeat("zz", 32)
	short := root.String()[:63] + "g"
	outDir := filepath.Join(t.TempDir(), "co")
	before := e.snapshot()

	for _, args := range [][]string{
		{"ls-tree", upper},
		{"ls-tree", nonHex},
		{"cat", short, "README.md"},
		{"checkout", upper, outDir},
		{"diff", root.String(), nonHex},
		{"fork", upper},
		{"ls-tree", "nosuchfork"},
		{"cat", "nosuchfork", "README.md"},
		{"diff", "nosuchfork", root.String()},
		{"checkout", "0123456789abcdef", outDir},
		{"fork", "nosuchfork"},
		{"forks", "rm", "nosuchfork"},
		{"cat", broken.String(), "gone.txt"},
		{"cat", broken.String(), "bad.txt"},
		{"cat", broken.String(), "deep/sub/f"},
		{"ls-tree", "-r", broken.String()},
		{"checkout", broken.String(), outDir},
		{"diff", broken.String(), other.String()},
		{"ls-tree", casstore.Sum([]byte("absent root")).String()},
	} {
		msg := e.fail(args...)
		if args[0] == "cat" && args[2] == "bad.txt" && !strings.Contains(msg, rot.String()) {
			t.Errorf("corrupt object error does not name it: %s", msg)
		}
		if _, err := os.Lstat(outDir); err == nil {
			t.Fatalf("%v left %s behind", args, outDir)
		}
	}
	if after := e.snapshot(); !reflect.DeepEqual(after, before) {
		t.Fatal("failed commands changed the store")
	}
}

package fuse

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore"
)

// logRecorder collects the log lines one view writes (a hook on the global logger,
// filtered by the view's directory).
type logRecorder struct {
	dir   string
	mu    sync.Mutex
	lines []string
}

func recordLogs(dir string) *logRecorder {
	r := &logRecorder{dir: dir}
	log.L.Logger.AddHook(r)
	return r
}

func (r *logRecorder) Levels() []log.Level { return []log.Level{log.ErrorLevel, log.WarnLevel} }

func (r *logRecorder) Fire(e *log.Entry) error {
	if e.Data["view"] != r.dir {
		return nil
	}
	var b strings.Builder
	b.WriteString(e.Message)
	for k, v := range e.Data {
		fmt.Fprintf(&b, " %s=%v", k, v)
	}
	r.mu.Lock()
	r.lines = append(r.lines, b.String())
	r.mu.Unlock()
	return nil
}

// has reports whether some line mentions every one of words.
func (r *logRecorder) has(words ...string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
next:
	for _, l := range r.lines {
		for _, w := range words {
			if !strings.Contains(l, w) {
				continue next
			}
		}
		return true
	}
	return false
}

// rawTree encodes entries without the strict encoder's checks, as a hostile or
// LunarFS-written tree could be.
func rawTree(entries ...casstore.Entry) []byte {
	var b []byte
	for _, e := range entries {
		b = binary.LittleEndian.AppendUint32(b, uint32(e.Mode))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(e.Name)))
		b = append(b, e.Name...)
		b = append(b, e.Hash[:]...)
	}
	return b
}

func TestDamagedObjectsFailOneFile(t *testing.T) {
	requireRoot(t)
	for _, m := range openModes {
		t.Run(m.name, func(t *testing.T) { testDamagedObjects(t, m.noOpen) })
	}
}

// testDamagedObjects checks that damaged objects cost one file or directory each,
// with served opens (the open fails) or with NoOpen (the read fails).
func testDamagedObjects(t *testing.T, noOpen bool) {
	s := newStore(t)
	base := ingestTree(t, s, writeFixture(t))
	tree, err := s.ReadTree(base)
	if err != nil {
		t.Fatal(err)
	}
	// Add a directory whose tree names "..", and a file whose blob is nowhere.
	good := lookupHash(t, s, base, "README.md").Hash
	hostile, err := s.PutBytes(rawTree(casstore.Entry{Mode: casstore.ModeFile, Name: "..", Hash: good}))
	if err != nil {
		t.Fatal(err)
	}
	missing := casstore.Sum([]byte("never stored"))
	tree = append(tree,
		casstore.Entry{Mode: casstore.ModeDir, Name: "hostile", Hash: hostile},
		casstore.Entry{Mode: casstore.ModeFile, Name: "missing.txt", Hash: missing})
	root, err := s.WriteTree(tree)
	if err != nil {
		t.Fatal(err)
	}
	// Corrupt a file's blob, a symlink's target and a subdirectory's tree in place.
	corrupt(t, s.Path(good))
	corrupt(t, s.Path(lookupHash(t, s, base, "src/up").Hash))
	corrupt(t, s.Path(lookupHash(t, s, base, "src/util").Hash))

	dir := sharedDir(t)
	logs := recordLogs(dir)
	v, err := Mount(t.Context(), s, root, dir, Options{NoOpen: noOpen})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Unmount() })
	requireOpenMode(t, v, noOpen)
	st := v.Stats()
	p := func(rel string) string { return filepath.Join(dir, rel) }

	for i := 0; i < 2; i++ { // failures are not cached into successes
		if _, err := os.ReadFile(p("README.md")); !isErrno(err, syscall.EIO) {
			t.Errorf("read corrupt blob: %v, want EIO", err)
		}
	}
	if st.Errors(ErrCorrupt) < 2 {
		t.Errorf("corrupt errors = %d", st.Errors(ErrCorrupt))
	}
	if !logs.has("/README.md", good.String()) {
		t.Errorf("no log line names the path and hash of the corrupt file: %q", logs.lines)
	}
	if _, err := os.Readlink(p("src/up")); !isErrno(err, syscall.EIO) {
		t.Errorf("readlink of a corrupt target: %v, want EIO", err)
	}
	if _, err := os.ReadDir(p("src/util")); !isErrno(err, syscall.EIO) {
		t.Errorf("readdir of a corrupt tree: %v, want EIO", err)
	}
	if _, err := os.Stat(p("src/util/strings.go")); !isErrno(err, syscall.EIO) {
		t.Errorf("lookup in a corrupt tree: %v, want EIO", err)
	}
	if _, err := os.ReadDir(p("hostile")); !isErrno(err, syscall.EIO) {
		t.Errorf("readdir of a tree naming '..': %v, want EIO", err)
	}
	if st.Errors(ErrTree) == 0 {
		t.Error("undecodable tree not counted as a tree error")
	}
	if !logs.has("/hostile", hostile.String()) {
		t.Errorf("no log line names the hostile tree: %q", logs.lines)
	}
	// A file whose blob is missing (and no source) is listed and looked up, but
	// cannot be read: its open fails, or in NoOpen mode its stat (its size is
	// unknowable, and a made-up size would read as content).
	if info, err := os.Lstat(p("missing.txt")); noOpen && !isErrno(err, syscall.EIO) {
		t.Errorf("stat missing.txt in NoOpen mode: %v %v, want EIO", info, err)
	} else if !noOpen && (err != nil || !info.Mode().IsRegular()) {
		t.Errorf("stat missing.txt: %v %v", info, err)
	}
	if _, err := os.ReadFile(p("missing.txt")); !isErrno(err, syscall.EIO) {
		t.Errorf("read missing blob: %v, want EIO", err)
	}
	if st.Errors(ErrMissing) == 0 {
		t.Error("missing blob not counted")
	}
	if !logs.has("/missing.txt", missing.String()) {
		t.Errorf("no log line names the path and hash of the missing file: %q", logs.lines)
	}

	// Everything else keeps working.
	if got := readString(t, p("src/main.go")); got != "package main\n\nfunc main() {}\n" {
		t.Errorf("src/main.go = %q", got)
	}
	if got := readString(t, p("big.bin")); len(got) != 1<<20 {
		t.Errorf("big.bin: %d bytes", len(got))
	}
	if got := readString(t, p("link")); !strings.HasPrefix(got, "package main") {
		t.Errorf("link: %q", got)
	}
	if got := listNames(t, p("src")); strings.Join(got, ",") != "main.go,up,util" {
		t.Errorf("src lists %v", got)
	}
	if got := listNames(t, dir); strings.Join(got, ",") != "README.md,big.bin,bin,empty,emptydir,hostile,link,missing.txt,src" {
		t.Errorf("root lists %v", got)
	}
}

package fuse

import (
	"io"
	"io/fs"
	stdlog "log"
	"path/filepath"
	"regexp"
	"sync"
	"testing"

	"github.com/containerd/log"
)

// openModes are the two ways a view can meet opens; tests of behaviour that must not
// depend on it run under both.
var openModes = []struct {
	name   string
	noOpen bool
}{
	{"open", false},
	{"noopen", true},
}

// requestTrace counts the FUSE requests one view receives, by opcode, from the
// request trace go-fuse writes with Options.Debug: what the kernel sent, whichever
// node method (if any) handled it.
type requestTrace struct {
	dir string

	mu     sync.Mutex
	counts map[string]int
	off    bool
}

var rxLine = regexp.MustCompile(`^rx \d+: ([A-Z0-9_]+) `)

// traceRequests raises the global logger to debug level (discarding its output) for
// the rest of the test, so that a view mounted with Debug reports its requests, and
// returns the counter for the view at dir.
func traceRequests(tb testing.TB, dir string) *requestTrace {
	tb.Helper()
	r := &requestTrace{dir: dir, counts: map[string]int{}}
	lg := log.L.Logger
	level, out, stdOut := lg.GetLevel(), lg.Out, stdlog.Writer()
	lg.SetLevel(log.DebugLevel)
	lg.SetOutput(io.Discard)
	stdlog.SetOutput(io.Discard) // go-fuse logs some of its trace there
	lg.AddHook(r)
	tb.Cleanup(func() {
		r.mu.Lock()
		r.off = true
		r.mu.Unlock()
		stdlog.SetOutput(stdOut)
		lg.SetOutput(out)
		lg.SetLevel(level)
	})
	return r
}

func (r *requestTrace) Levels() []log.Level { return []log.Level{log.DebugLevel} }

func (r *requestTrace) Fire(e *log.Entry) error {
	if e.Data["view"] != r.dir {
		return nil
	}
	m := rxLine.FindStringSubmatch(e.Message)
	if m == nil {
		return nil
	}
	r.mu.Lock()
	if !r.off {
		r.counts[m[1]]++
	}
	r.mu.Unlock()
	return nil
}

// take returns the counts so far and starts again from zero.
func (r *requestTrace) take() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.counts
	r.counts = map[string]int{}
	return c
}

// TestWarmPassRequests reads a part of the Go tree twice through a view and counts
// what the kernel asks the server. Served opens cost one OPEN (and RELEASE) per file
// on every pass while the pages stay cached; in NoOpen mode the first OPEN is the
// only one the connection ever sees, closes send nothing, and a warm pass reaches
// the server with no request at all for its files.
func TestWarmPassRequests(t *testing.T) {
	requireRoot(t)
	s, root := goStore(t)
	for _, m := range openModes {
		t.Run(m.name, func(t *testing.T) {
			dir := sharedDir(t)
			trace := traceRequests(t, dir)
			v := mountAt(t, s, root, dir, Options{NoOpen: m.noOpen, DisablePassthrough: true, Debug: true})
			if v.Dir() != dir {
				t.Fatalf("view at %s, traced %s", v.Dir(), dir)
			}
			if v.NoOpenActive() != m.noOpen {
				t.Fatalf("NoOpenActive = %v, want %v", v.NoOpenActive(), m.noOpen)
			}
			trace.take() // go-fuse's own requests at mount (INIT, its poll probe)
			sub := filepath.Join(v.Dir(), "go")
			buf := make([]byte, 256<<10)
			size := readTree(t, filepath.Join(goSrc, "go"), buf)
			files := countFiles(t, filepath.Join(goSrc, "go"))
			if files < 500 {
				t.Fatalf("only %d files under go/", files)
			}

			if got := readTree(t, sub, buf); got != size {
				t.Fatalf("first pass read %d bytes, want %d", got, size)
			}
			first := trace.take()
			t.Logf("first pass, %d files: %v", files, first)
			if first["READ"] < files/2 {
				t.Errorf("first pass: %d READs for %d files: is the trace working?", first["READ"], files)
			}
			reads := v.Stats().Reads.Load()
			if got := readTree(t, sub, buf); got != size {
				t.Fatalf("second pass read %d bytes, want %d", got, size)
			}
			second := trace.take()
			t.Logf("second pass: %v", second)
			if second["READ"] != 0 || v.Stats().Reads.Load() != reads {
				t.Errorf("second pass: %d READ requests (Stats.Reads +%d): the page cache was not kept",
					second["READ"], v.Stats().Reads.Load()-reads)
			}
			if second["LOOKUP"] != 0 || second["GETATTR"] != 0 {
				t.Errorf("second pass: %d LOOKUPs, %d GETATTRs: entries and attributes not cached", second["LOOKUP"], second["GETATTR"])
			}
			if !m.noOpen {
				if first["OPEN"] < files || second["OPEN"] < files {
					t.Errorf("served opens: %d then %d OPENs for %d files", first["OPEN"], second["OPEN"], files)
				}
				if v.Stats().Opens.Load() < uint64(2*files) {
					t.Errorf("Stats.Opens = %d for two passes over %d files", v.Stats().Opens.Load(), files)
				}
				return
			}
			if first["OPEN"] != 1 {
				t.Errorf("first pass: %d OPENs; the first ENOSYS should be the last", first["OPEN"])
			}
			if first["FLUSH"] > 1 || first["RELEASE"] != 0 {
				t.Errorf("first pass: %d FLUSH, %d RELEASE; closes should cost nothing", first["FLUSH"], first["RELEASE"])
			}
			if n := second["OPEN"] + second["FLUSH"] + second["RELEASE"]; n != 0 {
				t.Errorf("second pass: %d OPEN, %d FLUSH, %d RELEASE, want none", second["OPEN"], second["FLUSH"], second["RELEASE"])
			}
			if v.Stats().Opens.Load() != 0 {
				t.Errorf("Stats.Opens = %d in NoOpen mode", v.Stats().Opens.Load())
			}
		})
	}
}

func countFiles(tb testing.TB, dir string) int {
	tb.Helper()
	n := 0
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			n++
		}
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	return n
}

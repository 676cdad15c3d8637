package fuse

import (
	"bytes"
	"fmt"
	"io"
	"io/fs"
	stdlog "log"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
	"testing"

	"github.com/containerd/log"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
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

// requireOpenMode skips a NoOpen test on a kernel without no-open support, and
// fails if the view's mode is not the one asked for.
func requireOpenMode(tb testing.TB, v *View, noOpen bool) {
	tb.Helper()
	if noOpen && v.server.KernelSettings().Flags64()&gofuse.CAP_NO_OPEN_SUPPORT == 0 {
		tb.Skip("kernel lacks no-open support")
	}
	if v.NoOpenActive() != noOpen {
		tb.Fatalf("NoOpenActive = %v, want %v", v.NoOpenActive(), noOpen)
	}
	if noOpen && v.PassthroughActive() {
		tb.Fatal("passthrough active in NoOpen mode")
	}
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

// rxLine is a request in go-fuse's trace, except those for the file go-fuse opens
// itself at mount (node ^0) to probe poll support: its RELEASE may come late.
var rxLine = regexp.MustCompile(`^rx \d+: ([A-Z0-9_]+) n(\d+) `)

const pollHackNode = "18446744073709551615"

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
	if m == nil || m[2] == pollHackNode {
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

// TestWarmPassRequests reads a part of the Go tree through a view, then again warm,
// and counts what the kernel asks the server. Served opens cost an OPEN (and a
// RELEASE) per file on every pass while the pages stay cached; in NoOpen mode the
// first OPEN is the only one the connection ever sees, closes send nothing, and a
// warm pass reaches the server with no request at all for its files.
func TestWarmPassRequests(t *testing.T) {
	requireRoot(t)
	s, root := goStore(t)
	src := filepath.Join(goSrc, "go")
	buf := make([]byte, 256<<10)
	size := readTree(t, src, buf)
	files := countFiles(t, src)
	if files < 500 {
		t.Fatalf("only %d files under %s", files, src)
	}
	for _, m := range openModes {
		t.Run(m.name, func(t *testing.T) {
			dir := sharedDir(t)
			trace := traceRequests(t, dir)
			v := mountAt(t, s, root, dir, Options{NoOpen: m.noOpen, DisablePassthrough: true, Debug: true})
			if v.Dir() != dir {
				t.Fatalf("view at %s, traced %s", v.Dir(), dir)
			}
			requireOpenMode(t, v, m.noOpen)
			trace.take() // go-fuse's own requests at mount (INIT, its poll probe)
			sub := filepath.Join(v.Dir(), "go")
			if got := readTree(t, sub, buf); got != size {
				t.Fatalf("first pass read %d bytes, want %d", got, size)
			}
			first := trace.take()
			t.Logf("first pass, %d files: %v", files, first)
			if first["READ"] < files/2 {
				t.Fatalf("first pass: %d READs for %d files: is the trace working?", first["READ"], files)
			}
			if got := v.Stats().Reads.Load(); got != uint64(first["READ"]) {
				t.Errorf("first pass: Stats.Reads = %d, the kernel sent %d READs", got, first["READ"])
			}
			if m.noOpen {
				if first["OPEN"] != 1 {
					t.Errorf("first pass: %d OPENs; the first ENOSYS should be the last", first["OPEN"])
				}
				if first["FLUSH"] > 1 || first["RELEASE"] != 0 {
					t.Errorf("first pass: %d FLUSH, %d RELEASE; closes should cost nothing", first["FLUSH"], first["RELEASE"])
				}
			}

			// The kernel may evict the odd cached page by itself (this VM does so
			// without memory pressure, to natively read files as well), so a warm
			// pass with stray READs is repeated, up to three times. A view whose
			// page cache did not survive re-reads every file on every pass.
			for pass := 2; ; pass++ {
				reads := v.Stats().Reads.Load()
				if got := readTree(t, sub, buf); got != size {
					t.Fatalf("pass %d read %d bytes, want %d", pass, got, size)
				}
				warm := trace.take()
				t.Logf("pass %d: %v", pass, warm)
				if warm["LOOKUP"] != 0 || warm["GETATTR"] != 0 {
					t.Errorf("pass %d: %d LOOKUPs, %d GETATTRs: entries and attributes not cached", pass, warm["LOOKUP"], warm["GETATTR"])
				}
				if m.noOpen {
					if n := warm["OPEN"] + warm["FLUSH"] + warm["RELEASE"]; n != 0 {
						t.Errorf("pass %d: %d OPEN, %d FLUSH, %d RELEASE, want none", pass, warm["OPEN"], warm["FLUSH"], warm["RELEASE"])
					}
				} else if warm["OPEN"] < files { // (RELEASE is asynchronous: the last may come later)
					t.Errorf("pass %d: %d OPENs for %d files", pass, warm["OPEN"], files)
				}
				if warm["READ"] == 0 {
					if got := v.Stats().Reads.Load() - reads; got != 0 {
						t.Errorf("pass %d: Stats.Reads counted %d READs, the kernel sent none", pass, got)
					}
					break
				}
				if pass == 4 || warm["READ"] > files/10 {
					t.Fatalf("pass %d: %d READ requests: the page cache was not kept", pass, warm["READ"])
				}
			}
			if opens := v.Stats().Opens.Load(); m.noOpen && opens != 0 {
				t.Errorf("Stats.Opens = %d in NoOpen mode", opens)
			} else if !m.noOpen && opens < uint64(2*files) {
				t.Errorf("Stats.Opens = %d after two passes over %d files", opens, files)
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

// TestExecAndMmap runs a script from a view and maps a file of it, in both open
// modes: the kernel's exec and mmap paths open files too, and in NoOpen mode they
// must work without an open reply, reading through the view's page cache.
func TestExecAndMmap(t *testing.T) {
	forEachOpenMode(t, func(t *testing.T, noOpen bool) {
		s := newStore(t)
		root := ingestTree(t, s, writeFixture(t))
		v := mount(t, s, root, Options{NoOpen: noOpen, DisablePassthrough: true})
		requireOpenMode(t, v, noOpen)
		// The script is executed by a shell, and the mapping read by a child: the
		// process serving a FUSE mount must neither exec a file of it (the forking
		// thread waits for the child's exec without letting a garbage collection
		// stop the world) nor fault on a mapping of it, or a collection started
		// meanwhile waits for the server it has stopped.
		for range 2 { // the second run is served from the page cache
			out, err := exec.Command("/bin/sh", "-c", filepath.Join(v.Dir(), "bin/run.sh")).CombinedOutput()
			if err != nil || string(out) != "run\n" {
				t.Fatalf("exec bin/run.sh: %q, %v", out, err)
			}
		}
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(),
			mmapHelperEnv+"="+filepath.Join(v.Dir(), "big.bin"),
			mmapWantEnv+"="+s.Path(lookupHash(t, s, root, "big.bin").Hash))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("mapping big.bin: %v\n%s", err, out)
		}
		if v.Stats().Reads.Load() == 0 {
			t.Error("no READ reached the server")
		}
	})
}

// The test binary, run with mmapHelperEnv set, maps that file and compares it with
// the file named by mmapWantEnv, instead of running tests.
const (
	mmapHelperEnv = "TIDEPOOL_FUSE_TEST_MMAP"
	mmapWantEnv   = "TIDEPOOL_FUSE_TEST_MMAP_WANT"
)

func mmapCompare(mapped, wantPath string) int {
	want, err := os.ReadFile(wantPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	f, err := os.Open(mapped)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, len(want), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mmap:", err)
		return 1
	}
	defer unix.Munmap(m)
	if !bytes.Equal(m, want) {
		fmt.Fprintln(os.Stderr, "mapped content differs")
		return 1
	}
	return 0
}

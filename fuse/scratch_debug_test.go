package fuse

import (
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/log"
)

type allTrace struct {
	dir   string
	mu    sync.Mutex
	lines []string
}

func (r *allTrace) Levels() []log.Level { return []log.Level{log.DebugLevel} }
func (r *allTrace) Fire(e *log.Entry) error {
	if e.Data["view"] != r.dir {
		return nil
	}
	r.mu.Lock()
	r.lines = append(r.lines, e.Message)
	r.mu.Unlock()
	return nil
}

func TestScratchEviction(t *testing.T) {
	requireRoot(t)
	s, root := goStore(t)
	dir := sharedDir(t)
	traceRequests(t, dir)
	r := &allTrace{dir: dir}
	log.L.Logger.AddHook(r)
	mtime := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	v := mountAt(t, s, root, dir, Options{NoOpen: os.Getenv("SCRATCH_PLAIN") == "", DisablePassthrough: true, UID: testUID, GID: testGID, Mtime: mtime, Debug: true})
	compareTree(t, goSrc, v.Dir(), testUID, testGID, mtime)
	r.mu.Lock()
	r.lines = append(r.lines, "=== SECOND PASS")
	r.mu.Unlock()
	readTree(t, v.Dir(), make([]byte, 256<<10))
	r.mu.Lock()
	os.WriteFile("/tmp/scratch-trace.txt", []byte(strings.Join(r.lines, "\n")), 0o644)
	r.mu.Unlock()
}

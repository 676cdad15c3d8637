package casstore

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// Staged objects live in STORE/.tidepool-tmp until their batch publishes them. A
// process killed mid-batch leaves its staged files behind; they are never objects
// (only a rename publishes one), so they are safe to delete once nobody writes them.
//
// Who writes a temp file is in its name: "obj-PID.START-RANDOM", where START is the
// writing process's start time in clock ticks since boot (/proc/PID/stat field 22).
// A pid can be reused; a pid with the same start time cannot, so a file whose
// (PID, START) names no running process is a leftover. The first batch of every
// process removes such leftovers, as does tidepoold's start (SweepDeadTemp); fsck
// lists them (TempFiles). Files named otherwise (older Tidepool versions, LunarFS's
// "<hex>.tmp" in fan-out directories) fall back to SweepTemp's age rule.

var (
	selfStartOnce sync.Once
	selfStart     uint64
)

// tempPrefix names this process in its temp files.
func tempPrefix() string {
	selfStartOnce.Do(func() { selfStart, _ = procStart(os.Getpid()) })
	return fmt.Sprintf("obj-%d.%d-", os.Getpid(), selfStart)
}

// procStart reads a process's start time (clock ticks after boot) from /proc.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold anything: parse after
	// the last ')'.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); start time is field 22.
	if len(f) < 20 {
		return 0, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f)+2)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// tempOwner parses a temp file name; ok is false for names of another shape.
func tempOwner(name string) (pid int, start uint64, ok bool) {
	rest, found := strings.CutPrefix(name, "obj-")
	if !found {
		return 0, 0, false
	}
	owner, _, found := strings.Cut(rest, "-")
	if !found {
		return 0, 0, false
	}
	ps, ss, found := strings.Cut(owner, ".")
	if !found {
		return 0, 0, false
	}
	p, err1 := strconv.Atoi(ps)
	st, err2 := strconv.ParseUint(ss, 10, 64)
	if err1 != nil || err2 != nil || p <= 0 {
		return 0, 0, false
	}
	return p, st, true
}

// ownerAlive reports whether the process that named a temp file still runs. A
// process whose start time cannot be read counts as alive only if it exists.
func ownerAlive(pid int, start uint64) bool {
	got, err := procStart(pid)
	if err != nil {
		return !errors.Is(err, fs.ErrNotExist) && unix.Kill(pid, 0) != unix.ESRCH
	}
	return got == start
}

// TempFile is a staged object file found in the store's temp directory.
type TempFile struct {
	Path  string
	Size  int64
	PID   int  // the process that wrote it; 0 when the name does not say
	Alive bool // its writer still runs (or the name does not say, so it may)
}

// TempFiles lists the staged files in the store's temp directory and whether their
// writer still runs.
func (s *Store) TempFiles() ([]TempFile, error) {
	ents, err := os.ReadDir(s.tmp)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("list temp files: %w", err)
	}
	out := make([]TempFile, 0, len(ents))
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		t := TempFile{Path: filepath.Join(s.tmp, e.Name()), Alive: true}
		if info, err := e.Info(); err == nil {
			t.Size = info.Size()
		}
		if pid, start, ok := tempOwner(e.Name()); ok {
			t.PID, t.Alive = pid, ownerAlive(pid, start)
		}
		out = append(out, t)
	}
	return out, nil
}

// SweepDeadTemp removes the temp files whose writer no longer runs and returns how
// many it removed. Files of running writers, and files whose name does not say who
// wrote them, stay (SweepTemp removes the latter by age).
func (s *Store) SweepDeadTemp() (int, error) {
	files, err := s.TempFiles()
	if err != nil {
		return 0, err
	}
	n := 0
	for _, t := range files {
		if t.Alive {
			continue
		}
		if err := os.Remove(t.Path); err == nil {
			n++
		} else if !errors.Is(err, fs.ErrNotExist) {
			return n, fmt.Errorf("remove leftover temp file: %w", err)
		}
	}
	return n, nil
}

// sweepDeadOnce runs SweepDeadTemp on a process's first batch in this store. Errors
// are ignored: a read-only store (a LunarFS store of another user) still works.
func (s *Store) sweepDeadOnce() {
	s.deadOnce.Do(func() {
		if _, err := s.replayDeadJournals(); err != nil { // Begin holds the lock
			log.L.WithError(err).WithField("store", s.root).Warn("store: replaying journals of writers that died")
		}
		_, _ = s.SweepDeadTemp()
	})
}

package casstore

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// A journaled batch (journal.go) is durable once its journal is synced, so it returns
// to its caller then and writes its objects under their names in the background: a
// container being branched gets its new forks without waiting for a hundred file
// creations and renames, which under writeback pressure took tens of milliseconds.
//
// Until an object is under its name, a reader that misses it (Has, Size, Open,
// ReadAll, Verify, and the views' direct readers through Materialize) looks for it
// among this store's late objects, then in the store's journals (another process's
// batch, or a dead writer's not yet replayed), and writes it under its name itself.
// Objects are content-addressed, so whichever writer renames first wins and the other
// rename replaces identical bytes. A garbage collection cannot run meanwhile: the
// background publication holds the store's GC lock (shared) until it is done, and a
// journal is removed only after its objects are durable in place.
type lateObjects struct {
	mu      sync.Mutex
	objects map[Hash][]byte
	// entries are the objects of this process's committed journal writers
	// (stream.go) that are not under their names yet.
	entries map[Hash]journalEntry
	running sync.WaitGroup

	// The journals' index, read again when the journal directory changes.
	jmu    sync.Mutex
	jstamp unix.Timespec
	jindex map[Hash]journalEntry
}

// publishLateHook, if set (tests), runs before a background publication writes
// anything.
var publishLateHook func()

// journalEntry is where a journal holds an object's bytes: stored bytes at off,
// the object itself or (fewer than its size) one LZ4 block of it.
type journalEntry struct {
	path   string
	off    int64
	size   int64
	stored int64
}

func (e journalEntry) compressed() bool { return e.stored < e.size }

// addLate makes objects readable before they are under their names.
func (s *Store) addLate(objects map[Hash][]byte) { lateAdd(&s.late, &s.late.objects, objects) }

// dropLate forgets objects that are now under their names.
func (s *Store) dropLate(objects []Hash) { lateDrop(&s.late, &s.late.objects, objects) }

// lateAdd adds to one of l's indexes (held objects, journal entries) under its lock.
func lateAdd[V any](l *lateObjects, index *map[Hash]V, add map[Hash]V) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if *index == nil {
		*index = make(map[Hash]V, len(add))
	}
	maps.Copy(*index, add)
}

// lateDrop removes objects from one of l's indexes under its lock.
func lateDrop[V any](l *lateObjects, index *map[Hash]V, objects []Hash) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, h := range objects {
		delete(*index, h)
	}
}

func (s *Store) lateObject(h Hash) ([]byte, bool) {
	l := &s.late
	l.mu.Lock()
	defer l.mu.Unlock()
	data, ok := l.objects[h]
	return data, ok
}

// WaitPublished waits until every object this store's batches published is under its
// name.
func (s *Store) WaitPublished() { s.late.running.Wait() }

// Materialize makes sure a missing object whose batch returned before writing it
// under its name (see above) is there: from this store's late objects or from a
// journal. It reports whether the object is in place; false with a nil error means it
// is in neither (a missing object).
func (s *Store) Materialize(h Hash) (bool, error) {
	if _, err := os.Lstat(s.Path(h)); err == nil {
		return true, nil
	}
	if data, ok := s.lateObject(h); ok {
		if err := s.placeObject(h, data); err != nil {
			return false, err
		}
		return true, nil
	}
	if e, ok := s.lateEntry(h); ok {
		err := s.placeFromJournal(h, e)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return false, err
		}
		// Settled and removed meanwhile: look again below.
	}
	return s.journaledObject(h)
}

// placeObject writes data, known to hash to h and durable in a journal, under its
// name without syncing it.
func (s *Store) placeObject(h Hash, data []byte) error {
	return s.restoreObject(h, data, false)
}

// addLateEntries makes objects of a committed journal (stream.go) readable before
// they are under their names.
func (s *Store) addLateEntries(entries map[Hash]journalEntry) {
	lateAdd(&s.late, &s.late.entries, entries)
}

// dropLateEntries forgets journal entries whose objects are now under their names.
func (s *Store) dropLateEntries(objects []Hash) { lateDrop(&s.late, &s.late.entries, objects) }

func (s *Store) lateEntry(h Hash) (journalEntry, bool) {
	l := &s.late
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.entries[h]
	return e, ok
}

// journaledObject looks for h in the store's journals and writes it under its name
// from there; it reports whether h is in place.
func (s *Store) journaledObject(h Hash) (bool, error) {
	for attempt := 0; attempt < 2; attempt++ {
		e, ok, err := s.journalIndex(h)
		if err != nil || !ok {
			return false, err
		}
		err = s.placeFromJournal(h, e)
		if errors.Is(err, fs.ErrNotExist) {
			// Settled and removed since the index was read: its objects are durable in
			// place now, unless they were collected since.
			if _, err := os.Lstat(s.Path(h)); err == nil {
				return true, nil
			}
			continue
		}
		if err != nil {
			return false, err
		}
		log.L.WithField("object", h.String()).Debug("store: object written from a journal by its reader")
		return true, nil
	}
	return false, nil
}

// journalIndex finds h in the journals (see journalIndexes).
func (s *Store) journalIndex(h Hash) (journalEntry, bool, error) {
	var e journalEntry
	ok := false
	err := s.journalIndexes(func(index map[Hash]journalEntry) { e, ok = index[h] })
	return e, ok, err
}

// journalIndexes calls look with the index of every object in the store's journals,
// read again first if the journal directory changed since it was last read.
func (s *Store) journalIndexes(look func(map[Hash]journalEntry)) error {
	l := &s.late
	l.jmu.Lock()
	defer l.jmu.Unlock()
	var st unix.Stat_t
	if err := unix.Stat(s.journalDir(), &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat journal directory: %w", err)
	}
	if l.jindex == nil || st.Mtim != l.jstamp {
		index := map[Hash]journalEntry{}
		ents, err := os.ReadDir(s.journalDir())
		if err != nil {
			return fmt.Errorf("list journals: %w", err)
		}
		for _, e := range ents {
			if e.IsDir() || !strings.HasPrefix(e.Name(), "jnl-") {
				continue
			}
			p := filepath.Join(s.journalDir(), e.Name())
			if err := indexJournal(p, index); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
		l.jindex, l.jstamp = index, st.Mtim
	}
	look(l.jindex)
	return nil
}

// HasAll is Has for many objects, for a walker that meets a tree's entries together
// (a pull): one stat per object in place; the objects of this process's journals are
// known from memory, and the journals are looked at once for the rest (an object
// found only there is written under its name from it, checked, as Has does).
func (s *Store) HasAll(hs []Hash) ([]bool, error) {
	out := make([]bool, len(hs))
	var rest []int
	for i, h := range hs {
		_, err := os.Lstat(s.Path(h))
		switch {
		case err == nil:
			out[i] = true
		case errors.Is(err, fs.ErrNotExist):
			rest = append(rest, i)
		default:
			return nil, fmt.Errorf("stat object %s: %w", h, err)
		}
	}
	if len(rest) == 0 {
		return out, nil
	}
	l := &s.late
	var journaled []int
	l.mu.Lock()
	for _, i := range rest {
		_, inMemory := l.objects[hs[i]]
		_, inJournal := l.entries[hs[i]]
		out[i] = inMemory || inJournal
		if !out[i] {
			journaled = append(journaled, i)
		}
	}
	l.mu.Unlock()
	var found []int
	err := s.journalIndexes(func(index map[Hash]journalEntry) {
		for _, i := range journaled {
			if _, ok := index[hs[i]]; ok {
				found = append(found, i)
			}
		}
	})
	if err != nil {
		return nil, err
	}
	for _, i := range found {
		if out[i], err = s.Has(hs[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Empty reports whether the store holds no object: no fan-out directory, no journal
// and nothing of this process's waiting to reach its name. A walker that finds it
// empty (a pull into a fresh store) knows that every object is missing without a stat
// for each. Objects that another writer adds meanwhile are not seen: for such a walker
// they cost a redundant fetch, never a wrong answer about what it stored itself.
func (s *Store) Empty() (bool, error) {
	l := &s.late
	l.mu.Lock()
	pending := len(l.objects) + len(l.entries)
	l.mu.Unlock()
	if pending > 0 {
		return false, nil
	}
	ents, err := os.ReadDir(s.root)
	if err != nil {
		return false, fmt.Errorf("list store %s: %w", s.root, err)
	}
	for _, e := range ents {
		if e.IsDir() && isFanoutName(e.Name()) {
			return false, nil
		}
	}
	js, err := s.Journals()
	return err == nil && len(js) == 0, err
}

// indexJournal adds where the journal at p holds each of its objects; a torn tail
// ends it, as in a replay.
func indexJournal(p string, index map[Hash]journalEntry) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	jr, ok := newJournalReader(f, 64<<10)
	if !ok {
		return nil
	}
	for {
		e, h, ok := jr.next()
		if !ok || !jr.skip(e) {
			return nil
		}
		e.path = p
		index[h] = e
	}
}

// Package arrivalspool keeps the roots a command put in the store while no tidepoold
// could be told of them, until a tidepoold starts and prepares their views.
//
// A root that reaches the store through tidepoold (a container's commit, a fork made
// or moved through its API) or through a command while tidepoold runs (`tidepool
// ingest` tells it over the API) has its kernel view images built in the background,
// before the first container on it is created. A root ingested while tidepoold was
// stopped (host set-up before the service starts, an upgrade window) was told to
// nobody: its first container scanned every tree object on its create path. So a
// command records each root it puts in the store here first, then tells a running
// tidepoold and drops the record once that worked; a tidepoold takes the records left
// when it has started (after it publishes its API address, so that a command either
// finds it or leaves a record it will take). Losing a record loses only preparation,
// so records are written without fsync.
//
// The spool is ROOT/arrivals, mode 0700: one file per root, named by its hash, holding
// the path of the store the root was put in (a tidepoold prepares only roots of its
// own store). Only who can write the Tidepool root can add records.
package arrivalspool

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
)

// DirName is the spool's directory under a Tidepool root.
const DirName = "arrivals"

// maxStorePath bounds a record's content (a path).
const maxStorePath = 4096

// staleTemp is how old a temp file of an interrupted Add is when Take removes it.
const staleTemp = time.Hour

// Dir returns the spool directory of the Tidepool root root.
func Dir(root string) string { return filepath.Join(root, DirName) }

// Add records that h was put in the store at storeDir. An existing record of h is
// replaced (it becomes the newest). The spool is made in root, which must exist (a
// command on a store of its own does not create a Tidepool root).
func Add(root, storeDir string, h casstore.Hash) error {
	dir := Dir(root)
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("arrival spool: %w", err)
	}
	abs, err := filepath.Abs(storeDir)
	if err != nil {
		return fmt.Errorf("arrival spool: store %s: %w", storeDir, err)
	}
	f, err := os.CreateTemp(dir, ".tmp-")
	if err != nil {
		return fmt.Errorf("arrival spool: %w", err)
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(abs); err != nil {
		f.Close()
		return fmt.Errorf("arrival spool: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("arrival spool: %w", err)
	}
	if err := os.Rename(f.Name(), filepath.Join(dir, h.String())); err != nil {
		return fmt.Errorf("arrival spool: %w", err)
	}
	return nil
}

// Remove drops the record of h (a tidepoold was told of it); none is fine.
func Remove(root string, h casstore.Hash) error {
	if err := os.Remove(filepath.Join(Dir(root), h.String())); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("arrival spool: %w", err)
	}
	return nil
}

// Take removes every record from the spool and returns the roots of those of the
// store at storeDir, newest first, at most max of them (the newest are the likeliest
// to be run next; the others' first containers build their views, as without a
// record). skipped counts the files that were no record of that store (another
// store, or not a record at all); they are removed too. A spool that does not exist
// holds nothing.
func Take(root, storeDir string, max int) (roots []casstore.Hash, skipped int, err error) {
	dir := Dir(root)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("arrival spool: %w", err)
	}
	store, err := os.Stat(storeDir)
	if err != nil {
		return nil, 0, fmt.Errorf("arrival spool: store %s: %w", storeDir, err)
	}
	type record struct {
		root casstore.Hash
		at   time.Time
	}
	var recs []record
	var errs []error
	drop := func(name string) {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".tmp-") {
			if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > staleTemp {
				drop(name)
			}
			continue
		}
		h, at, ok := read(dir, e, store)
		drop(name)
		if !ok {
			skipped++
			continue
		}
		recs = append(recs, record{h, at})
	}
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].at.After(recs[j].at) })
	for _, r := range recs[:min(max, len(recs))] {
		roots = append(roots, r.root)
	}
	if len(errs) > 0 {
		return roots, skipped, fmt.Errorf("arrival spool: %w", errors.Join(errs...))
	}
	return roots, skipped, nil
}

// read reads one spool entry: its root and when it was recorded; ok is false unless
// it is a record of store.
func read(dir string, e fs.DirEntry, store fs.FileInfo) (h casstore.Hash, at time.Time, ok bool) {
	h, err := casstore.ParseHash(e.Name())
	if err != nil || !e.Type().IsRegular() {
		return h, at, false
	}
	info, err := e.Info()
	if err != nil || info.Size() > maxStorePath {
		return h, at, false
	}
	b, err := os.ReadFile(filepath.Join(dir, e.Name()))
	if err != nil {
		return h, at, false
	}
	st, err := os.Stat(string(b))
	if err != nil || !os.SameFile(st, store) {
		return h, at, false
	}
	return h, info.ModTime(), true
}

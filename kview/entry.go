package kview

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// This file is how a cache entry shows that it is whole.
//
// An entry's files are each written to a temp file and renamed into place, without
// an fsync: a build is on the create path of a container, and an fsync of the Go
// tree's 2.7 MiB image and of the cache directory costs 4 to 6 ms on the reference
// VM. A crash of the host can then leave any of them shorter than written, down to
// empty: ext4 (data=ordered, delayed allocation) and xfs grow a file's size on disk
// as its pages are written back, which a rename does not wait for, so what a crash
// leaves within that size is what was written. Used as it is, such an entry would do
// harm:
//   - a truncated image mounts (its superblock is whole) and fails on the directories
//     it lost ("structure needs cleaning"), in every container on that tree;
//   - an empty one fails to mount, and reads as a host without EROFS file mounts;
//   - a truncated object list lets a view mount with objects missing from the store;
//   - truncated owner slots derive an image with inodes of the old owner.
//
// So KEY.json, the entry's record, is written last and records the sizes of the
// other three files. An entry is used (a cache hit, a derivation, the owner index)
// only when its record reads and names its view and the files have those sizes;
// anything else is built again, over it. The check is a read of the record and three
// stats.

// errIncomplete: an entry's files do not have the sizes its record gives, or its
// record does not read. It matches fs.ErrNotExist: the entry is built again.
var errIncomplete error = entryError("image cache entry is incomplete (cut short by a crash while it was written?)")

// errUnsized: the record gives no sizes (an entry written before records had them).
// It matches fs.ErrNotExist: the entry is built again, once.
var errUnsized error = entryError("image cache entry has no sizes in its record (written by an earlier version)")

// entryError is an entry that is there but not usable: to its callers, one that is
// not there.
type entryError string

func (e entryError) Error() string        { return string(e) }
func (e entryError) Is(target error) bool { return target == fs.ErrNotExist }

// readRecord reads key's record and checks that it is the record of spec's view.
// A missing record wraps fs.ErrNotExist; one that does not read or names another view
// wraps errIncomplete.
func (c *Cache) readRecord(key string, spec Spec) (meta, error) {
	var m meta
	b, err := os.ReadFile(c.path(key, ".json"))
	if err != nil {
		return m, fmt.Errorf("image cache record %s: %w", c.path(key, ".json"), err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("image cache record %s: %w: %w", c.path(key, ".json"), errIncomplete, err)
	}
	if m.Root != spec.Root || m.Prefix != spec.Prefix || m.UID != spec.UID || m.GID != spec.GID {
		return m, fmt.Errorf("image cache record %s is of another view: %w", c.path(key, ".json"), errIncomplete)
	}
	if m.ImageBytes <= 0 {
		return m, fmt.Errorf("image cache record %s: %w", c.path(key, ".json"), errUnsized)
	}
	return m, nil
}

// wholeEntry returns the record of key's entry (the cache entry of spec) if the
// entry is whole: its record reads and names spec, and the other files have the
// sizes it gives.
func (c *Cache) wholeEntry(key string, spec Spec) (meta, error) {
	m, err := c.readRecord(key, spec)
	if err != nil {
		return m, err
	}
	return m, c.filesWhole(key, m)
}

// filesWhole checks that key's image, object list and owner slots have the sizes its
// record m gives (a record without sizes, which readRecord refuses, fails here too:
// no image is 0 bytes).
func (c *Cache) filesWhole(key string, m meta) error {
	for _, f := range []struct {
		ext  string
		size int64
	}{{".erofs", m.ImageBytes}, {".objects", m.ObjectsBytes}, {".owners", m.OwnersBytes}} {
		if err := c.sized(key, f.ext, f.size); err != nil {
			return err
		}
	}
	return nil
}

// sized checks that key's file ext exists and has size bytes.
func (c *Cache) sized(key, ext string, size int64) error {
	info, err := os.Stat(c.path(key, ext))
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return sizeIs(c.path(key, ext), info.Size(), size)
}

// readSized reads the file name, which its entry's record says is size bytes long,
// into buf (grown if it is too small) and returns its bytes, or an error if its size
// is another.
func readSized(name string, size int64, buf []byte) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return buf, err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return buf, fmt.Errorf("image cache: %w", err)
	}
	if err := sizeIs(name, info.Size(), size); err != nil {
		return buf, err
	}
	if int64(cap(buf)) < size {
		buf = make([]byte, size)
	}
	buf = buf[:size]
	if n, err := io.ReadFull(f, buf); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return buf, sizeIs(name, int64(n), size) // cut short since the stat
		}
		return buf, fmt.Errorf("image cache: read %s: %w", name, err)
	}
	return buf, nil
}

// sizeIs checks a file's size (got) against the size its entry's record gives.
func sizeIs(name string, got, want int64) error {
	if got != want {
		return fmt.Errorf("%s is %d bytes, its record says %d: %w", name, got, want, errIncomplete)
	}
	return nil
}

// incomplete reports whether err says that an entry exists but is not whole (as
// opposed to absent), which is worth a line in the log when it is built again.
func incomplete(err error) bool {
	return errors.Is(err, errIncomplete) || errors.Is(err, errUnsized)
}

package casstore

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"unicode/utf8"
)

// Mode is the type and permission of a tree entry, stored as a little-endian u32.
type Mode uint32

// The modes a tree may hold. LunarFS writes the first three; ModeSymlink is Tidepool's
// addition (git's value), used only outside --lunar-strict so LunarFS never sees it in
// roots that it made.
const (
	ModeDir     Mode = 0o040000
	ModeFile    Mode = 0o100644
	ModeExec    Mode = 0o100755
	ModeSymlink Mode = 0o120000
)

// Valid reports whether m is one of the four known modes.
func (m Mode) Valid() bool {
	switch m {
	case ModeDir, ModeFile, ModeExec, ModeSymlink:
		return true
	}
	return false
}

// IsDir reports whether the entry points at a tree object.
func (m Mode) IsDir() bool { return m == ModeDir }

// String renders the mode as six octal digits, as git and `tidepool ls-tree` do.
func (m Mode) String() string { return fmt.Sprintf("%06o", uint32(m)) }

// FileMode converts to the os.FileMode a materialized entry gets.
func (m Mode) FileMode() os.FileMode {
	switch m {
	case ModeDir:
		return os.ModeDir | 0o755
	case ModeExec:
		return 0o755
	case ModeSymlink:
		return os.ModeSymlink | 0o777
	default:
		return 0o644
	}
}

// Entry is one child of a tree: a name, a mode and the hash of the child object (a
// tree for ModeDir, the link target bytes for ModeSymlink, file content otherwise).
type Entry struct {
	Mode Mode
	Name string
	Hash Hash
}

// Tree is a decoded tree object: entries sorted by the raw bytes of their names.
type Tree []Entry

// Lookup finds the entry called name.
func (t Tree) Lookup(name string) (Entry, bool) {
	i := sort.Search(len(t), func(i int) bool { return t[i].Name >= name })
	if i < len(t) && t[i].Name == name {
		return t[i], true
	}
	return Entry{}, false
}

const entryHeader = 8 // mode u32 + name_len u32

// ErrBadName is wrapped by errors about entry names that could escape a directory or
// collide with another entry.
var ErrBadName = errors.New("unsafe tree entry name")

// CheckName refuses names that are empty, "." or "..", contain '/' or NUL, or are not
// valid UTF-8: such a name would address a path outside its directory or be ambiguous.
func CheckName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty name", ErrBadName)
	case name == "." || name == "..":
		return fmt.Errorf("%w: %q", ErrBadName, name)
	case strings.ContainsRune(name, '/'):
		return fmt.Errorf("%w: %q contains '/'", ErrBadName, name)
	case strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("%w: %q contains NUL", ErrBadName, name)
	case !utf8.ValidString(name):
		return fmt.Errorf("%w: %q is not valid UTF-8", ErrBadName, name)
	}
	return nil
}

// EncodeTree serializes entries in LunarFS's encoding. It is strict: names must pass
// CheckName and be unique, modes must be known. Entries are sorted by name bytes; the
// input slice is not modified.
func EncodeTree(entries []Entry) ([]byte, error) {
	sorted := make([]Entry, len(entries))
	copy(sorted, entries)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Name < sorted[j].Name })
	size := 0
	for i, e := range sorted {
		if err := CheckName(e.Name); err != nil {
			return nil, fmt.Errorf("encode tree: %w", err)
		}
		if !e.Mode.Valid() {
			return nil, fmt.Errorf("encode tree: entry %q: unknown mode %o", e.Name, uint32(e.Mode))
		}
		if i > 0 && sorted[i-1].Name == e.Name {
			return nil, fmt.Errorf("encode tree: %w: duplicate name %q", ErrBadName, e.Name)
		}
		size += entryHeader + len(e.Name) + HashSize
	}
	buf := make([]byte, 0, size)
	for _, e := range sorted {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(e.Mode))
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(e.Name)))
		buf = append(buf, e.Name...)
		buf = append(buf, e.Hash[:]...)
	}
	return buf, nil
}

// DecodeTree parses a tree object. Everything LunarFS writes parses, and anything that
// could be dangerous to materialize is refused before the caller sees a single entry:
// truncated data, unknown modes, unsafe or non-UTF-8 names, duplicates and entries out
// of order (a second encoding of one logical tree would give it a second hash).
func DecodeTree(b []byte) (Tree, error) {
	// First the framing, to size the entries and their names: one allocation for
	// each instead of one a name and the growth of the slice (a build decodes a
	// tree object per directory of a tree).
	n, nameBytes := 0, 0
	for off := 0; off < len(b); n++ {
		if len(b)-off < entryHeader {
			return nil, fmt.Errorf("decode tree: truncated entry header at offset %d (%d bytes left)", off, len(b)-off)
		}
		nameLen := binary.LittleEndian.Uint32(b[off+4:])
		off += entryHeader
		if uint64(nameLen)+HashSize > uint64(len(b)-off) {
			return nil, fmt.Errorf("decode tree: entry at offset %d runs past the end (name length %d, %d bytes left)", off-entryHeader, nameLen, len(b)-off)
		}
		off += int(nameLen) + HashSize
		nameBytes += int(nameLen)
	}
	if n == 0 {
		return nil, nil
	}
	// Every name is a piece of one string: grown once, the builder never moves
	// what it holds, so the names taken from it stay valid as it fills.
	var names strings.Builder
	names.Grow(nameBytes)
	t := make(Tree, 0, n)
	for off := 0; off < len(b); {
		mode := Mode(binary.LittleEndian.Uint32(b[off:]))
		nameLen := int(binary.LittleEndian.Uint32(b[off+4:]))
		off += entryHeader
		at := names.Len()
		names.Write(b[off : off+nameLen])
		name := names.String()[at:]
		off += nameLen
		var h Hash
		copy(h[:], b[off:off+HashSize])
		off += HashSize
		if err := CheckName(name); err != nil {
			return nil, fmt.Errorf("decode tree: %w", err)
		}
		if !mode.Valid() {
			return nil, fmt.Errorf("decode tree: entry %q: unknown mode %o", name, uint32(mode))
		}
		if n := len(t); n > 0 {
			switch prev := t[n-1].Name; {
			case prev == name:
				return nil, fmt.Errorf("decode tree: %w: duplicate name %q", ErrBadName, name)
			case prev > name:
				return nil, fmt.Errorf("decode tree: entries out of order: %q after %q", name, prev)
			}
		}
		t = append(t, Entry{Mode: mode, Name: name, Hash: h})
	}
	return t, nil
}

// Equal reports whether two decoded trees hold the same entries.
func (t Tree) Equal(u Tree) bool {
	if len(t) != len(u) {
		return false
	}
	for i := range t {
		if t[i] != u[i] {
			return false
		}
	}
	return true
}

package ingest

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/tidepool-dev/tidepool/casstore"
)

// gitDir is the one name skipped at any depth, whether it is a directory or a file
// (a worktree's or submodule's .git file). The match is exact and case-sensitive.
const gitDir = ".git"

// lossyName converts an OS file name to UTF-8 the way LunarFS does (Rust's
// to_string_lossy): every maximal ill-formed subsequence becomes one U+FFFD. That is
// the Unicode "substitution of maximal subparts" practice: a truncated but well-begun
// sequence ("\xe2\x82") is one replacement, each byte that cannot begin or continue a
// sequence is one replacement of its own. (strings.ToValidUTF8 differs: it replaces
// a whole run of bad bytes with a single U+FFFD.)
func lossyName(raw string) string {
	if utf8.ValidString(raw) {
		return raw
	}
	var sb strings.Builder
	sb.Grow(len(raw) + 8)
	for i := 0; i < len(raw); {
		r, size := utf8.DecodeRuneInString(raw[i:])
		if r != utf8.RuneError || size > 1 {
			sb.WriteString(raw[i : i+size])
			i += size
			continue
		}
		sb.WriteRune(utf8.RuneError)
		i += maximalSubpart(raw[i:])
	}
	return sb.String()
}

// maximalSubpart returns the length of the ill-formed sequence at the start of s: the
// lead byte plus however many of the following bytes would still have been valid
// continuations (at least 1).
func maximalSubpart(s string) int {
	lead := s[0]
	var need int
	lo, hi := byte(0x80), byte(0xbf) // allowed range of the second byte
	switch {
	case lead >= 0xc2 && lead <= 0xdf:
		need = 1
	case lead == 0xe0:
		need, lo = 2, 0xa0
	case lead >= 0xe1 && lead <= 0xec, lead == 0xee, lead == 0xef:
		need = 2
	case lead == 0xed:
		need, hi = 2, 0x9f
	case lead == 0xf0:
		need, lo = 3, 0x90
	case lead >= 0xf1 && lead <= 0xf3:
		need = 3
	case lead == 0xf4:
		need, hi = 3, 0x8f
	default:
		return 1 // 0x80..0xc1, 0xf5..0xff: never a lead byte
	}
	n := 1
	for k := 0; k < need && n < len(s); k++ {
		c := s[n]
		if k == 0 && (c < lo || c > hi) || k > 0 && (c < 0x80 || c > 0xbf) {
			break
		}
		n++
	}
	return n
}

// checkCollisions refuses a directory whose kept children share a converted name
// (only non-UTF-8 names can collide). children is sorted by name on return.
func checkCollisions(dir string, children []child) error {
	sort.Slice(children, func(i, j int) bool { return children[i].name < children[j].name })
	for i := 1; i < len(children); i++ {
		a, b := children[i-1], children[i]
		if a.name == b.name {
			return fmt.Errorf("directory %q: %q and %q both read as %q: %w", dir, a.raw, b.raw, a.name, ErrNameCollision)
		}
	}
	return nil
}

// execMode maps permission bits to a file mode: executable if any x bit is set.
func execMode(perm uint32) casstore.Mode {
	if perm&0o111 != 0 {
		return casstore.ModeExec
	}
	return casstore.ModeFile
}

// ValidatePrefix checks a workdir prefix for Upper: "" (or ".") for the upper's root,
// otherwise a clean relative path without "..", such as "app" or "srv/api".
func ValidatePrefix(prefix string) error {
	if prefix == "" || prefix == "." {
		return nil
	}
	switch {
	case filepath.IsAbs(prefix):
		return fmt.Errorf("prefix %q must be relative to the upper directory: %w", prefix, errInvalid)
	case filepath.Clean(prefix) != prefix:
		return fmt.Errorf("prefix %q is not clean (want %q): %w", prefix, filepath.Clean(prefix), errInvalid)
	case !filepath.IsLocal(prefix):
		return fmt.Errorf("prefix %q must not contain \"..\": %w", prefix, errInvalid)
	}
	for _, c := range strings.Split(prefix, "/") {
		if c == ".." {
			return fmt.Errorf("prefix %q must not contain \"..\": %w", prefix, errInvalid)
		}
	}
	return nil
}

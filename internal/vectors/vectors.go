// Package vectors loads the LunarFS golden vectors that the codec and ingest tests
// must reproduce byte for byte. The repository keeps its own copy
// (testdata/lunarfs.json, embedded) so that a plain clone tests with nothing beside
// it; $TIDEPOOL_VECTORS points at the shared original to cross-check the copy.
package vectors

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
)

// File is the whole vector document.
type File struct {
	EmptyHash   string      `json:"empty_hash"`
	Trees       []Tree      `json:"trees"`
	Directories []Directory `json:"directories"`
}

// Tree is an encoding vector: entries in the order given, the expected bytes and hash.
type Tree struct {
	ID       string  `json:"id"`
	Entries  []Entry `json:"entries"`
	BytesHex string  `json:"bytes_hex"`
	Hash     string  `json:"hash"`
}

// Entry is one tree entry of a vector.
type Entry struct {
	Mode uint32 `json:"mode"`
	Name string `json:"name"`
	Hash string `json:"hash"`
}

// Directory is an ingest fixture: files, empty dirs and things ingest must skip.
type Directory struct {
	ID        string    `json:"id"`
	Files     []FileDef `json:"files"`
	EmptyDirs []string  `json:"empty_dirs"`
	Skipped   []Skipped `json:"skipped"`
	Root      string    `json:"root"`
}

// FileDef is a regular file of a fixture.
type FileDef struct {
	Path    string `json:"path"`
	Content string `json:"content"`
	Mode    uint32 `json:"mode"`
}

// Skipped is a fixture entry that ingest must leave out.
type Skipped struct {
	Kind   string `json:"kind"` // dir, file, symlink, fifo
	Path   string `json:"path"`
	Target string `json:"target"`
}

// EnvVar names an outside copy of lunarfs.json (the shared original) that Load
// cross-checks the repository's copy against.
const EnvVar = "TIDEPOOL_VECTORS"

// lunarfsJSON is the repository's copy of the vectors: embedded, so the tests of
// a plain clone need nothing beside it and find it from any working directory.
//
//go:embed testdata/lunarfs.json
var lunarfsJSON []byte

// Load parses the repository's copy of the vectors. When $TIDEPOOL_VECTORS names
// another copy, Load also reads that one and fails unless both hold the same
// JSON document (formatting aside): a copy that drifted from the original must
// be noticed, not silently tested against.
func Load() (*File, error) {
	if p := os.Getenv(EnvVar); p != "" {
		if err := crossCheck(p); err != nil {
			return nil, err
		}
	}
	var f File
	if err := json.Unmarshal(lunarfsJSON, &f); err != nil {
		return nil, fmt.Errorf("parse internal/vectors/testdata/lunarfs.json: %w", err)
	}
	return &f, nil
}

// crossCheck compares the outside copy at path with the embedded one.
func crossCheck(path string) error {
	outside, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("load LunarFS vectors from $%s: %w", EnvVar, err)
	}
	var want, got any
	if err := json.Unmarshal(outside, &want); err != nil {
		return fmt.Errorf("parse %s ($%s): %w", path, EnvVar, err)
	}
	if err := json.Unmarshal(lunarfsJSON, &got); err != nil {
		return fmt.Errorf("parse internal/vectors/testdata/lunarfs.json: %w", err)
	}
	if !reflect.DeepEqual(want, got) {
		return fmt.Errorf("LunarFS vectors: internal/vectors/testdata/lunarfs.json differs from %s ($%s): "+
			"copy the original over the repository's copy (cp %s internal/vectors/testdata/lunarfs.json) and review the diff", path, EnvVar, path)
	}
	return nil
}

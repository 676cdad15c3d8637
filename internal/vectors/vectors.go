// Package vectors loads the LunarFS golden vectors (../shared/vectors/lunarfs.json) that
// the codec and ingest tests must reproduce byte for byte.
package vectors

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
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

// Path locates lunarfs.json: $TIDEPOOL_VECTORS, else ../shared/vectors beside the
// repository checkout.
func Path() string {
	if p := os.Getenv("TIDEPOOL_VECTORS"); p != "" {
		return p
	}
	_, self, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(self), "..", "..", "..", "shared", "vectors", "lunarfs.json")
}

// Load reads and parses the vectors.
func Load() (*File, error) {
	b, err := os.ReadFile(Path())
	if err != nil {
		return nil, fmt.Errorf("load LunarFS vectors: %w", err)
	}
	var f File
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("parse %s: %w", Path(), err)
	}
	return &f, nil
}

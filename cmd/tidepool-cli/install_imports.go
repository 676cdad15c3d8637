package main

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// How install makes containerd's config import the drop-in without rewriting the
// operator's lines: the file is parsed only to read `version` and `imports`; if an
// import pattern already matches the drop-in (containerd 2.x's default config has
// imports = ['/etc/containerd/conf.d/*.toml']) nothing changes. Otherwise exactly one
// line changes: the top-level single-line `imports = [...]` gains the drop-in's path
// before its closing bracket, or, without one, a new `imports = [...]` line goes right
// after the top-level `version` line (top-level keys must precede the first table).
// The manifest records the line before and after, and uninstall puts the old line
// back only if the file still holds ours. A multi-line imports array is not edited:
// install stops and says which line to add.

// mainConfig is what install reads from containerd's config.
type mainConfig struct {
	Version int      `toml:"version"`
	Imports []string `toml:"imports"`
}

// importEdit is one changed line of containerd's config.
type importEdit struct {
	// Before is the line install replaced; empty when it inserted Line.
	Before string `json:"before,omitempty"`
	// Line is the line install wrote.
	Line string `json:"line"`
}

var (
	importsLine = regexp.MustCompile(`^\s*imports\s*=`)
	versionLine = regexp.MustCompile(`^\s*version\s*=`)
	tableLine   = regexp.MustCompile(`^\s*\[`)
)

func parseMainConfig(data []byte) (mainConfig, error) {
	var mc mainConfig
	if err := toml.Unmarshal(data, &mc); err != nil {
		return mc, fmt.Errorf("parse containerd config: %w", err)
	}
	return mc, nil
}

// importsDropIn reports whether an import pattern matches path (containerd resolves
// imports with filepath.Glob, relative ones against the config's directory).
func importsDropIn(imports []string, configPath, path string) bool {
	for _, pat := range imports {
		if !filepath.IsAbs(pat) {
			pat = filepath.Join(filepath.Dir(configPath), pat)
		}
		if ok, err := filepath.Match(pat, path); err == nil && ok {
			return true
		}
	}
	return false
}

// addImport returns data with path added to its imports, and the edit made.
func addImport(data []byte, path string) ([]byte, importEdit, error) {
	lines := strings.SplitAfter(string(data), "\n")
	quoted := "'" + path + "'"
	versionAt := -1
	for i, l := range lines {
		if tableLine.MatchString(l) {
			break // past the top-level keys
		}
		if versionLine.MatchString(l) && versionAt < 0 {
			versionAt = i
		}
		if !importsLine.MatchString(l) {
			continue
		}
		body := strings.TrimRight(l, "\n")
		open, closing := strings.Index(body, "["), strings.LastIndex(body, "]")
		if open < 0 || closing < open {
			return nil, importEdit{}, fmt.Errorf("containerd config line %d: imports spans several lines; add %s to it by hand", i+1, quoted)
		}
		inner := strings.TrimSpace(body[open+1 : closing])
		sep := ", "
		if inner == "" {
			sep = ""
		} else if strings.HasSuffix(inner, ",") {
			sep = " "
		}
		// Insert right after the last non-space character before the bracket.
		at := open + 1 + len(strings.TrimRight(body[open+1:closing], " \t"))
		newBody := body[:at] + sep + quoted + body[at:]
		edit := importEdit{Before: body, Line: newBody}
		lines[i] = newBody + l[len(body):]
		return []byte(strings.Join(lines, "")), edit, nil
	}
	line := "imports = [" + quoted + "]"
	edit := importEdit{Line: line}
	at := 0
	if versionAt >= 0 {
		at = versionAt + 1
		if !strings.HasSuffix(lines[versionAt], "\n") {
			lines[versionAt] += "\n"
		}
	}
	out := append(lines[:at:at], append([]string{line + "\n"}, lines[at:]...)...)
	return []byte(strings.Join(out, "")), edit, nil
}

// removeImport undoes addImport's edit if the file still holds the line it wrote.
func removeImport(data []byte, edit importEdit) ([]byte, bool) {
	lines := strings.SplitAfter(string(data), "\n")
	for i, l := range lines {
		if strings.TrimRight(l, "\n") != edit.Line {
			continue
		}
		if edit.Before == "" {
			lines = append(lines[:i], lines[i+1:]...)
		} else {
			lines[i] = edit.Before + l[len(edit.Line):]
		}
		return []byte(strings.Join(lines, "")), true
	}
	return data, false
}

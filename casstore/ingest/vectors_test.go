package ingest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
	"github.com/tidepool-dev/tidepool/internal/vectors"
)

// buildFixture recreates a golden directory on disk, including everything LunarFS
// skips, and returns the number of skipped items and the symlinks it made.
func buildFixture(t *testing.T, d vectors.Directory, dir string) map[string]string {
	t.Helper()
	links := map[string]string{}
	mkdirs(t, dir)
	for _, f := range d.Files {
		writeFile(t, filepath.Join(dir, f.Path), f.Content, os.FileMode(f.Mode))
	}
	for _, e := range d.EmptyDirs {
		mkdirs(t, filepath.Join(dir, e))
	}
	for _, sk := range d.Skipped {
		p := filepath.Join(dir, sk.Path)
		switch sk.Kind {
		case "dir":
			writeFile(t, filepath.Join(p, "HEAD"), "ref: refs/heads/main\n", 0o644)
		case "file":
			writeFile(t, p, "gitdir: ../.git/worktrees/x\n", 0o644)
		case "symlink":
			symlink(t, sk.Target, p)
			links[sk.Path] = sk.Target
		case "fifo":
			mkfifo(t, p)
		default:
			t.Fatalf("fixture %s: unknown skipped kind %q", d.ID, sk.Kind)
		}
	}
	return links
}

func TestGoldenDirectories(t *testing.T) {
	v, err := vectors.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Directories) == 0 {
		t.Fatal("no directory vectors")
	}
	for _, d := range v.Directories {
		t.Run(d.ID, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "fixture")
			links := buildFixture(t, d, dir)
			s := casstoretest.NewStore(t)

			strict, st, err := Dir(t.Context(), s, dir, Options{LunarStrict: true})
			if err != nil {
				t.Fatal(err)
			}
			if strict.String() != d.Root {
				t.Fatalf("LunarStrict root %s, want %s\n%s", strict, d.Root, strings.Join(listing(t, s, strict), "\n"))
			}
			if st.Files != int64(len(d.Files)) || st.Symlinks != 0 || st.Skipped != int64(len(d.Skipped)) {
				t.Errorf("strict stats %+v: want %d files, 0 symlinks, %d skipped", st, len(d.Files), len(d.Skipped))
			}

			// Default mode: the same tree plus the symlinks, each a 120000 entry whose
			// blob is the target; dropping them gives back LunarFS's root exactly.
			def, st, err := Dir(t.Context(), s, dir, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if st.Symlinks != int64(len(links)) || st.Skipped != int64(len(d.Skipped)-len(links)) {
				t.Errorf("default stats %+v: want %d symlinks, %d skipped", st, len(links), len(d.Skipped)-len(links))
			}
			tree, err := s.ReadTree(def)
			if err != nil {
				t.Fatal(err)
			}
			var rest []casstore.Entry
			for _, e := range tree {
				target, isLink := links[e.Name]
				if !isLink {
					rest = append(rest, e)
					continue
				}
				if e.Mode != casstore.ModeSymlink {
					t.Errorf("%s: mode %s, want 120000", e.Name, e.Mode)
				}
				blob, err := s.ReadAll(e.Hash, 4096)
				if err != nil {
					t.Fatal(err)
				}
				if string(blob) != target {
					t.Errorf("%s: blob %q, want target %q", e.Name, blob, target)
				}
				delete(links, e.Name)
			}
			if len(links) != 0 {
				t.Errorf("symlinks missing from the default-mode tree: %v", links)
			}
			data, err := casstore.EncodeTree(rest)
			if err != nil {
				t.Fatal(err)
			}
			if got := casstore.Sum(data); got.String() != d.Root {
				t.Errorf("default root without its symlinks = %s, want %s", got, d.Root)
			}
		})
	}
}

// TestRootSymlinkFollowed: a symlink given as the path is followed (LunarFS
// canonicalizes the root), while symlinks inside are not.
func TestRootSymlinkFollowed(t *testing.T) {
	tmp := t.TempDir()
	real := filepath.Join(tmp, "real")
	writeFile(t, filepath.Join(real, "a.txt"), "hello", 0o644)
	writeFile(t, filepath.Join(real, "b.txt"), "world", 0o644)
	symlink(t, "real", filepath.Join(tmp, "link"))
	s := casstoretest.NewStore(t)
	got := mustDir(t, s, filepath.Join(tmp, "link"), Options{LunarStrict: true})
	if want := "4b093b7ebd7dc129041900ab2c2942ffd771f6ed03f143592e8a06daf5d6b901"; got.String() != want {
		t.Fatalf("root via symlink = %s, want flat-two-files root %s", got, want)
	}
}

package imagebuild

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// formatVersion changes whenever Build's output for a given Spec changes, so
// archives cached by an older builder are not reused.
const formatVersion = "imagebuild/1"

// Archive is a built image archive on disk.
type Archive struct {
	Path string `json:"path"`
	Result
}

// Key is a content hash of spec: every field, plus for host copies the path,
// size, mtime, inode and mode of each file they read. Host file contents are
// not read: a host file replaced or rewritten in place changes its inode or
// mtime, and hashing a 100 MB node binary on every test run is what the cache
// is there to avoid.
func Key(spec Spec) (string, error) {
	h := sha256.New()
	field := func(parts ...string) {
		for _, p := range parts {
			h.Write([]byte(strconv.Itoa(len(p))))
			h.Write([]byte{':'})
			h.Write([]byte(p))
		}
		h.Write([]byte{'\n'})
	}
	cfg, err := json.Marshal(spec.Config.imageConfig())
	if err != nil {
		return "", fmt.Errorf("image key: %w", err)
	}
	field(formatVersion, string(cfg), strconv.FormatBool(spec.Gzip), spec.Arch)
	for i, l := range spec.Layers {
		field("layer", strconv.Itoa(i))
		for _, e := range l {
			field(e.Kind.String(), e.Path, e.Mode.String(), strconv.Itoa(e.UID), strconv.Itoa(e.GID), e.Target, e.Source)
			switch e.Kind {
			case KindFile:
				sum := sha256.Sum256(e.Data)
				field(hex.EncodeToString(sum[:]))
			case KindHostFile:
				fi, err := os.Stat(e.Source)
				if err != nil {
					return "", fmt.Errorf("image key: %w", err)
				}
				field(statKey(fi))
			case KindHostDir:
				if err := hashTree(h, e.Source); err != nil {
					return "", fmt.Errorf("image key: %w", err)
				}
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func statKey(fi fs.FileInfo) string {
	ino := uint64(0)
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		ino = st.Ino
	}
	return fmt.Sprintf("%v %d %d %d", fi.Mode(), fi.Size(), fi.ModTime().UnixNano(), ino)
}

func hashTree(h hash.Hash, root string) error {
	root, err := filepath.EvalSymlinks(root)
	if err != nil {
		return err
	}
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		line := rel + "\x00" + statKey(fi)
		if fi.Mode()&fs.ModeSymlink != 0 {
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += "\x00" + target
		}
		h.Write([]byte(line + "\n"))
		return nil
	})
}

// Cached returns the archive of spec under dir (building it the first time),
// named by Key. Concurrent builders of one spec are safe: each writes its own
// temporary file and the rename is atomic.
func Cached(spec Spec, dir string) (Archive, error) {
	key, err := Key(spec)
	if err != nil {
		return Archive{}, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Archive{}, fmt.Errorf("image cache: %w", err)
	}
	a := Archive{Path: filepath.Join(dir, key+".tar")}
	meta := filepath.Join(dir, key+".json")
	if data, err := os.ReadFile(meta); err == nil {
		if json.Unmarshal(data, &a.Result) == nil {
			if _, err := os.Stat(a.Path); err == nil {
				return a, nil
			}
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return Archive{}, fmt.Errorf("image cache: %w", err)
	}
	if a.Result, err = BuildFile(spec, a.Path); err != nil {
		return Archive{}, err
	}
	data, err := json.Marshal(a.Result)
	if err != nil {
		return Archive{}, fmt.Errorf("image cache: %w", err)
	}
	if err := writeFileAtomic(meta, data); err != nil {
		return Archive{}, fmt.Errorf("image cache: %w", err)
	}
	return a, nil
}

// DefaultCacheDir is where archives are cached: <repo>/.cache/images, or
// $TIDEPOOL_CACHE_DIR/images.
func DefaultCacheDir() (string, error) {
	return testenv.CacheDir("images")
}

func writeFileAtomic(dst string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return err
	}
	return os.Rename(f.Name(), dst)
}

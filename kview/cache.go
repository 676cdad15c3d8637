package kview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Cache keeps the images of views under one directory, one per (root, prefix, owner):
// KEY.erofs (the image), KEY.objects (the file objects it points at, 32 bytes each,
// so a cache hit checks their presence without decoding a tree) and KEY.json (the
// spec, so collection can tell which roots mounted views show). Each image is built
// once (single-flight) and shared by every view of that tree.
type Cache struct {
	dir   string
	store *casstore.Store
	sf    singleflight.Group
	// gate: builds and mounts hold it shared from build to mount, Collect exclusively,
	// so an image is never collected between being built and being mounted.
	gate  sync.RWMutex
	stats *Stats
	memo  *treeMemo // decoded trees, shared by the builds of every image
}

// meta is KEY.json.
type meta struct {
	Root   casstore.Hash `json:"root"`
	Prefix string        `json:"prefix"`
	UID    uint32        `json:"uid"`
	GID    uint32        `json:"gid"`
	Files  int           `json:"files"`
	Bytes  int64         `json:"bytes"`
}

// NewCache opens (creating) the image cache at dir.
func NewCache(dir string, store *casstore.Store, stats *Stats) (*Cache, error) {
	if err := ensureDir(dir); err != nil {
		return nil, err
	}
	if stats == nil {
		stats = &Stats{}
	}
	return &Cache{dir: dir, store: store, stats: stats, memo: newTreeMemo(defaultMemoEntries)}, nil
}

// Dir is the cache directory.
func (c *Cache) Dir() string { return c.dir }

func (c *Cache) path(key, ext string) string { return filepath.Join(c.dir, key+ext) }

// image returns the path of spec's image, building it if it is not cached. Either
// way every object the tree's files point at has been found in the store (a
// *MissingError otherwise). The caller holds c.gate shared.
func (c *Cache) image(ctx context.Context, spec Spec) (string, error) {
	key := spec.Key()
	img := c.path(key, ".erofs")
	if _, err := os.Stat(img); err == nil {
		if err := c.checkObjects(ctx, spec, key); err == nil {
			c.stats.CacheHits.Add(1)
			now := time.Now()
			_ = os.Chtimes(img, now, now) // last use, for Collect's grace
			return img, nil
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		// No usable object list: build again, which checks the tree.
	}
	ran := false
	_, err, _ := c.sf.Do(key, func() (any, error) { ran = true; return nil, c.build(ctx, spec, key) })
	if err != nil {
		return "", err
	}
	if !ran { // waited for another mount's build of the same image
		c.stats.CacheHits.Add(1)
	}
	return img, nil
}

// checkObjects checks that every object in KEY.objects is in the store.
func (c *Cache) checkObjects(ctx context.Context, spec Spec, key string) error {
	b, err := os.ReadFile(c.path(key, ".objects"))
	if err != nil {
		return err
	}
	if len(b)%len(casstore.Hash{}) != 0 {
		return fmt.Errorf("object list %s is truncated: %w", c.path(key, ".objects"), fs.ErrNotExist)
	}
	od := newObjDirs(c.store)
	defer od.close()
	var missing []casstore.Hash
	for i := 0; i < len(b); i += len(casstore.Hash{}) {
		if i%(1024*32) == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		var h casstore.Hash
		copy(h[:], b[i:])
		if _, ok := od.known(h); ok {
			continue
		}
		if _, ok, err := od.stat(h); err != nil {
			return err
		} else if !ok {
			missing = append(missing, h)
		}
	}
	if len(missing) > 0 {
		return &MissingError{Root: spec.Root, Objects: missing}
	}
	return nil
}

// build scans the tree and writes KEY.erofs, KEY.objects and KEY.json, each through a
// temp file and a rename, the image last.
func (c *Cache) build(ctx context.Context, spec Spec, key string) error {
	start := time.Now()
	t, err := scan(ctx, c.store, spec, c.memo)
	if err != nil {
		return err
	}
	objs := make([]byte, 0, 32*len(t.objects))
	for _, h := range t.objects {
		objs = append(objs, h[:]...)
	}
	m, _ := json.Marshal(meta{Root: spec.Root, Prefix: spec.Prefix, UID: spec.UID, GID: spec.GID, Files: t.Files, Bytes: t.Bytes})
	if err := c.writeFile(key+".objects", func(f *os.File) error { _, err := f.Write(objs); return err }); err != nil {
		return err
	}
	if err := c.writeFile(key+".json", func(f *os.File) error { _, err := f.Write(m); return err }); err != nil {
		return err
	}
	var size int64
	err = c.writeFile(key+".erofs", func(f *os.File) error {
		if err := t.WriteImage(f); err != nil {
			return err
		}
		off, err := f.Seek(0, 2)
		size = off
		return err
	})
	if err != nil {
		return err
	}
	c.stats.Builds.Add(1)
	c.stats.BuildNanos.Add(int64(time.Since(start)))
	c.stats.BuildBytes.Add(size)
	return nil
}

func (c *Cache) writeFile(name string, fill func(*os.File) error) error {
	f, err := os.CreateTemp(c.dir, ".tmp-"+name+"-")
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	defer os.Remove(f.Name())
	if err := fill(f); err != nil {
		f.Close()
		return err
	}
	// Start writing the file back now, in the background. Left dirty, its pages would
	// be written by the next sync of this filesystem, and every unmount of an overlay
	// with an upper layer here is one (the rootfs of a container whose task is
	// deleted): a new image (2.7 MiB for the Go source tree) would add its writeback
	// to some container's exit. Only speed depends on it.
	_ = unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return fmt.Errorf("image cache: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	if err := os.Rename(f.Name(), filepath.Join(c.dir, name)); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return nil
}

// mountedKeys returns the image keys of every kernel view mounted on the host.
func mountedKeys() (map[string]bool, error) {
	ms, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("overlay", "erofs"))
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	keys := map[string]bool{}
	for _, m := range ms {
		if v := asView(m); v != nil {
			keys[v.Key] = true
		}
	}
	return keys, nil
}

// DefaultGrace is how long an image no view uses stays cached after its last use, so
// that containers run one after another on one tree (ctr run --rm in a loop) build it
// once.
const DefaultGrace = 10 * time.Minute

// Collect removes the cached images that no mounted view uses and that were last used
// more than grace ago, and returns how many.
func (c *Cache) Collect(ctx context.Context, grace time.Duration) (int, error) {
	c.gate.Lock()
	defer c.gate.Unlock()
	keys, err := mountedKeys()
	if err != nil {
		return 0, err
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return 0, fmt.Errorf("image cache: %w", err)
	}
	n := 0
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".tmp-") {
			if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Hour {
				os.Remove(filepath.Join(c.dir, name))
			}
			continue
		}
		key, _, ok := strings.Cut(name, ".")
		if !ok || keys[key] {
			continue
		}
		if grace > 0 {
			if info, err := os.Stat(c.path(key, ".erofs")); err == nil && time.Since(info.ModTime()) < grace {
				continue
			}
		}
		if err := os.Remove(filepath.Join(c.dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return n, fmt.Errorf("image cache: %w", err)
		}
		if strings.HasSuffix(name, ".erofs") {
			n++
		}
	}
	return n, nil
}

// MountedRoots returns the roots shown by kernel views mounted on the host, so that a
// garbage collection keeps their objects even when no fork or pin names them.
func (c *Cache) MountedRoots() ([]casstore.Hash, error) {
	keys, err := mountedKeys()
	if err != nil {
		return nil, err
	}
	var roots []casstore.Hash
	for k := range keys {
		b, err := os.ReadFile(c.path(k, ".json"))
		if err != nil {
			continue // another cache's view, or its record is gone
		}
		var m meta
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, fmt.Errorf("image cache record %s: %w", c.path(k, ".json"), err)
		}
		roots = append(roots, m.Root)
	}
	return roots, nil
}

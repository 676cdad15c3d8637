package kview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Cache keeps the images of views under one directory, one per (root, prefix, owner):
// KEY.erofs (the image), KEY.objects (the file objects it points at, 32 bytes each,
// so a cache hit checks their presence without decoding a tree), KEY.owners (where
// its owned inodes are, to derive the image for another owner: derive.go) and
// KEY.json (the spec, so collection can tell which roots mounted views show). Each
// image is built once (single-flight) and shared by every view of that tree.
type Cache struct {
	dir   string
	store *casstore.Store
	sf    singleflight.Group
	// gate: builds and mounts hold it shared from build to mount, Collect exclusively,
	// so an image is never collected between being built and being mounted.
	gate  sync.RWMutex
	stats *Stats
	memo  *treeMemo // decoded trees, shared by the builds of every image
	// scratch keeps the memory of recent builds for the next ones (scratch.go).
	scratch scratchPool
	// checked lets a cache hit skip the check of an object list that the size index
	// showed whole and nothing has forgotten since (checked.go).
	checked checkedLists

	// owners indexes the cached images by tree and owner class (derive.go), so that
	// an image for a new owner can be derived from one of the same tree; filled from
	// the cache's records when the cache opens, then by every build. An entry may
	// name an image collected since: deriving from it fails and the image is built.
	ownersMu sync.Mutex
	owners   map[ownerClass]Spec
	// lastRoots are the roots of the images found when the cache opened, the most
	// recently used first (loadRecords), for WarmTrees.
	lastRoots []casstore.Hash
}

// ownerClass is a tree as its images show it (root and prefix), and whether its
// owner fits compact inodes: the images of one class share their layout.
type ownerClass struct {
	root   casstore.Hash
	prefix string
	fits16 bool
}

func classOf(s Spec) ownerClass { return ownerClass{s.Root, s.Prefix, ownerFits16(s.UID, s.GID)} }

// meta is KEY.json, the entry's record: written last, with the sizes of the entry's
// other files, by which a reader tells a whole entry (entry.go).
type meta struct {
	Root   casstore.Hash `json:"root"`
	Prefix string        `json:"prefix"`
	UID    uint32        `json:"uid"`
	GID    uint32        `json:"gid"`
	Files  int           `json:"files"`
	Bytes  int64         `json:"bytes"`

	ImageBytes   int64 `json:"image_bytes,omitempty"`
	ObjectsBytes int64 `json:"objects_bytes"`
	OwnersBytes  int64 `json:"owners_bytes"`
}

// NewCache opens (creating) the image cache at dir.
func NewCache(dir string, store *casstore.Store, stats *Stats) (*Cache, error) {
	if err := ensureDir(dir); err != nil {
		return nil, err
	}
	if stats == nil {
		stats = &Stats{}
	}
	c := &Cache{dir: dir, store: store, stats: stats, memo: newTreeMemo(defaultMemoEntries)}
	c.loadRecords()
	return c, nil
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
	if _, err := c.wholeEntry(key, spec); err == nil {
		if err := c.checkObjects(ctx, spec, key, nil); err == nil {
			c.stats.CacheHits.Add(1)
			now := time.Now()
			_ = os.Chtimes(img, now, now) // last use, for Collect's grace
			return img, nil
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		// No usable object list: build again, which checks the tree.
	} else if incomplete(err) {
		l := log.G(ctx).WithError(err).WithField("image", key)
		if errors.Is(err, errUnsized) {
			l.Info("kernel view image cache entry from an earlier version: building it again")
		} else {
			l.Warn("kernel view image cache entry is not whole: building it again")
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", err
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

// checkObjects checks that every object in key's object list is in the store,
// unless the size index showed them all and has forgotten nothing since
// (checked.go), and remembers the list as checked if the index knew every object.
// list is the content of KEY.objects if the caller read it already (derive needs it
// anyway); nil reads it, and only when the check is not skipped.
func (c *Cache) checkObjects(ctx context.Context, spec Spec, key string, list []byte) error {
	od := newObjDirs(c.store)
	defer od.close()
	if c.listUnchanged(od, key) {
		return nil
	}
	c.checked.drop(key)
	b := list
	if b == nil {
		var err error
		if b, err = os.ReadFile(c.path(key, ".objects")); err != nil {
			return err
		}
	}
	if len(b)%len(casstore.Hash{}) != 0 {
		return fmt.Errorf("object list %s is truncated: %w", c.path(key, ".objects"), fs.ErrNotExist)
	}
	c.stats.ObjectChecks.Add(1)
	whole := od.epochOK
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
		whole = false
		if _, ok, err := od.stat(h); err != nil {
			return err
		} else if !ok {
			missing = append(missing, h)
		}
	}
	if len(missing) > 0 {
		return &MissingError{Root: spec.Root, Objects: missing}
	}
	if whole {
		c.checked.set(key, od.epoch)
	}
	return nil
}

// build writes KEY.objects, KEY.json, KEY.erofs and KEY.owners, each through a temp
// file and a rename (see writeAll): the image derived from a cached image of the same tree for
// another owner when there is one of the same owner class (derive.go), else from a
// scan of the tree.
func (c *Cache) build(ctx context.Context, spec Spec, key string) error {
	start := time.Now()
	if from, ok := c.sibling(spec); ok {
		size, err := c.derive(ctx, spec, key, from)
		var miss *MissingError
		switch {
		case err == nil:
			c.stats.Derived.Add(1)
			c.count(start, size)
			return nil
		case errors.As(err, &miss), ctx.Err() != nil:
			return err // the same tree: a scan would find the same objects missing
		case errors.Is(err, fs.ErrNotExist):
			c.forget(from) // collected since
		}
		log.G(ctx).WithError(err).WithField("from", from.Key()).Debug("kernel view image not derived; building it")
	}
	c.checked.drop(key)
	sc := c.scratch.get()
	defer c.scratch.put(sc) // t and everything it holds are sc's: they end here
	t, err := scan(ctx, c.store, spec, c.memo, sc)
	if err != nil {
		return err
	}
	scanned := time.Now()
	c.stats.TreesRead.Add(int64(t.TreesRead))
	objs := sc.objList[:0]
	for _, h := range t.objects {
		objs = append(objs, h[:]...)
	}
	sc.objList = objs
	size, err := c.writeAll(spec, key, meta{Files: t.Files, Bytes: t.Bytes}, objs, func(f *os.File) ([]byte, error) {
		l, err := t.writeImage(f, sc)
		if err != nil {
			return nil, err
		}
		return l.ownerSlots(), nil
	})
	if err != nil {
		return err
	}
	if t.sizesKnown {
		c.checked.set(key, t.sizesAt) // the scan found every file's object in the index
	}
	c.stats.Builds.Add(1)
	c.count(start, size)
	log.G(ctx).WithFields(log.Fields{"root": spec.Root.Short(), "image": key, "files": t.Files, "trees_read": t.TreesRead,
		"sizes_stated": t.Stated, "scan": scanned.Sub(start), "write": time.Since(scanned)}).Debug("kernel view image built")
	return nil
}

// count adds an image built or derived since start, of size bytes, to the stats.
func (c *Cache) count(start time.Time, size int64) {
	c.stats.BuildNanos.Add(int64(time.Since(start)))
	c.stats.BuildBytes.Add(size)
}

// writeAll writes an image's files: KEY.objects, the image (written by image, which
// returns its owner slots), KEY.owners, and last KEY.json: m with spec's fields and
// the sizes of the other three, which make the entry whole (entry.go). The image
// joins the owner index. It returns the image's size.
func (c *Cache) writeAll(spec Spec, key string, m meta, objs []byte, image func(*os.File) ([]byte, error)) (int64, error) {
	m.Root, m.Prefix, m.UID, m.GID = spec.Root, spec.Prefix, spec.UID, spec.GID
	var err error
	if m.ObjectsBytes, err = c.writeFile(key+".objects", func(f *os.File) error { _, err := f.Write(objs); return err }); err != nil {
		return 0, err
	}
	var slots []byte
	m.ImageBytes, err = c.writeFile(key+".erofs", func(f *os.File) (err error) {
		slots, err = image(f)
		return err
	})
	if err != nil {
		return 0, err
	}
	if m.OwnersBytes, err = c.writeFile(key+".owners", func(f *os.File) error { _, err := f.Write(slots); return err }); err != nil {
		return 0, err
	}
	mj, err := json.Marshal(m)
	if err != nil {
		return 0, fmt.Errorf("image cache record: %w", err)
	}
	if _, err := c.writeFile(key+".json", func(f *os.File) error { _, err := f.Write(mj); return err }); err != nil {
		return 0, err
	}
	c.remember(spec)
	return m.ImageBytes, nil
}

// derive writes spec's image from the cached image of from (the same tree, another
// owner of the same class): it checks that every object the tree's files point at is
// still in the store, as a cache hit does, then copies from's image with the owner of
// every owned inode rewritten.
func (c *Cache) derive(ctx context.Context, spec Spec, key string, from Spec) (int64, error) {
	fk := from.Key()
	m, err := c.readRecord(fk, from)
	if err != nil {
		return 0, err
	}
	// Each file is checked against the record as it is read: the record vouches for
	// what was read, whatever happened to the files in between. The bytes go into a
	// build's scratch (scratch.go), which the image is written from.
	sc := c.scratch.get()
	defer c.scratch.put(sc)
	read := func(ext string, size int64, buf *[]byte) ([]byte, error) {
		b, err := readSized(c.path(fk, ext), size, *buf)
		*buf = b
		return b, err
	}
	objs, err := read(".objects", m.ObjectsBytes, &sc.objList)
	if err != nil {
		return 0, err
	}
	if err := c.checkObjects(ctx, spec, fk, objs); err != nil {
		return 0, err
	}
	slots, err := read(".owners", m.OwnersBytes, &sc.slots)
	if err != nil {
		return 0, err
	}
	img, err := read(".erofs", m.ImageBytes, &sc.image)
	if err != nil {
		return 0, err
	}
	if err := deriveImage(img, slots, from.UID, from.GID, spec.UID, spec.GID); err != nil {
		return 0, fmt.Errorf("image %s: %w", c.path(fk, ".erofs"), err)
	}
	size, err := c.writeAll(spec, key, m, objs, func(f *os.File) ([]byte, error) {
		_, err := f.Write(img)
		return slots, err
	})
	if err != nil {
		c.checked.drop(key)
		return 0, err
	}
	c.checked.copy(fk, key) // the same object list
	return size, nil
}

// sibling returns the spec of a cached image of spec's class, if the index knows one.
func (c *Cache) sibling(spec Spec) (Spec, bool) {
	c.ownersMu.Lock()
	defer c.ownersMu.Unlock()
	from, ok := c.owners[classOf(spec)]
	return from, ok
}

// remember puts a built image in the owner index.
func (c *Cache) remember(spec Spec) {
	c.ownersMu.Lock()
	defer c.ownersMu.Unlock()
	c.owners[classOf(spec)] = spec
}

// forget drops spec from the owner index.
func (c *Cache) forget(spec Spec) {
	c.ownersMu.Lock()
	defer c.ownersMu.Unlock()
	if c.owners[classOf(spec)] == spec {
		delete(c.owners, classOf(spec))
	}
}

// loadRecords reads the records of the images in the cache (those a previous
// tidepoold built) once, when the cache opens: it fills the owner index and lists the
// roots the images show, the most recently used first (an image's mtime is its last
// use), for WarmTrees. Only whole entries (entry.go) join the owner index.
func (c *Cache) loadRecords() {
	c.owners = map[ownerClass]Spec{}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return
	}
	names := make(map[string]fs.DirEntry, len(ents))
	for _, e := range ents {
		names[e.Name()] = e
	}
	type used struct {
		root casstore.Hash
		at   time.Time
	}
	var images []used
	for _, e := range ents {
		key, ok := strings.CutSuffix(e.Name(), ".json")
		img := names[key+".erofs"]
		if !ok || strings.HasPrefix(key, ".") || img == nil {
			continue
		}
		b, err := os.ReadFile(c.path(key, ".json"))
		var m meta
		if err != nil || json.Unmarshal(b, &m) != nil {
			continue
		}
		spec := Spec{Root: m.Root, Prefix: m.Prefix, UID: m.UID, GID: m.GID}
		if spec.Key() != key {
			continue
		}
		// Its root's trees are worth decoding whatever became of its files (they are
		// read from the store); only a whole entry is derived from.
		if info, err := img.Info(); err == nil {
			images = append(images, used{spec.Root, info.ModTime()})
		}
		if c.filesWhole(key, m) == nil {
			c.owners[classOf(spec)] = spec
		}
	}
	sort.Slice(images, func(i, j int) bool { return images[i].at.After(images[j].at) })
	seen := map[casstore.Hash]bool{}
	for _, im := range images {
		if !seen[im.root] {
			seen[im.root] = true
			c.lastRoots = append(c.lastRoots, im.root)
		}
	}
}

// writeFile writes the cache file name (through a temp file and a rename) with fill,
// and returns its size.
func (c *Cache) writeFile(name string, fill func(*os.File) error) (int64, error) {
	f, err := os.CreateTemp(c.dir, ".tmp-"+name+"-")
	if errors.Is(err, fs.ErrNotExist) {
		// The cache directory was removed under this process (an operator clearing a
		// cache): make it again. What it held is built again when used, and the views
		// mounted from it keep their image files open.
		if err = ensureDir(c.dir); err == nil {
			f, err = os.CreateTemp(c.dir, ".tmp-"+name+"-")
		}
	}
	if err != nil {
		return 0, fmt.Errorf("image cache: %w", err)
	}
	defer os.Remove(f.Name())
	if err := fill(f); err != nil {
		f.Close()
		return 0, err
	}
	info, err := f.Stat()
	if err != nil {
		f.Close()
		return 0, fmt.Errorf("image cache: %w", err)
	}
	// Start writing the file back now, in the background. Left dirty, its pages would
	// be written by the next sync of this filesystem, and every unmount of an overlay
	// with an upper layer here is one (the rootfs of a container whose task is
	// deleted): a new image (2.7 MiB for the Go source tree) would add its writeback
	// to some container's exit. Only speed depends on it.
	_ = unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return 0, fmt.Errorf("image cache: %w", err)
	}
	if err := f.Close(); err != nil {
		return 0, fmt.Errorf("image cache: %w", err)
	}
	if err := os.Rename(f.Name(), filepath.Join(c.dir, name)); err != nil {
		return 0, fmt.Errorf("image cache: %w", err)
	}
	return info.Size(), nil
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
		c.checked.drop(key)
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

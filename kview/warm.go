package kview

import (
	"context"
	"encoding/json"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
)

// This file warms a new process's memo of decoded trees.
//
// Building an image for a tree the memo lacks reads and decodes every tree object
// (about 1,300 for the Go source tree), and right after a start a process has
// decoded nothing: the first view at a new workdir or for a new owner, or of a
// commit's root, paid two to three times what the same build costs a running
// daemon. The roots this host showed last are in the cache's records, and their
// tree objects are in the store, so a process that starts decodes those trees in
// the background, once, and its first builds find them as a running daemon would.
// Nothing new is kept on disk: the trees are read from the store, verified as any
// build verifies them.

// WarmTrees decodes into the memo the trees of the roots of the most recently used
// cached images, up to roots distinct roots and half the memo's size (a warm-up
// never evicts what it loaded). It returns how many tree objects it read. Images
// collected meanwhile and trees whose objects have gone are skipped: a warm-up only
// saves time.
func (c *Cache) WarmTrees(ctx context.Context, roots int) (int, error) {
	n := 0
	for _, root := range c.recentRoots(roots) {
		if c.memo.size() >= c.memo.maxEntries/2 {
			break
		}
		od := newObjDirs(c.store)
		od.memo, od.treesOnly = c.memo, true
		scans, err := readTrees(ctx, od, root)
		od.close()
		if err != nil {
			if ctx.Err() != nil {
				return n, ctx.Err()
			}
			continue
		}
		for _, ds := range scans {
			if ds.read {
				n++
			}
		}
	}
	c.stats.TreesWarmed.Add(int64(n))
	return n, nil
}

// recentRoots returns the distinct roots of the cached images, the most recently
// used first (an image's mtime is its last use), at most n.
func (c *Cache) recentRoots(n int) []casstore.Hash {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return nil
	}
	type used struct {
		key string
		at  time.Time
	}
	var imgs []used
	for _, e := range ents {
		key, ok := strings.CutSuffix(e.Name(), ".erofs")
		if !ok || strings.HasPrefix(key, ".") {
			continue
		}
		if info, err := e.Info(); err == nil {
			imgs = append(imgs, used{key, info.ModTime()})
		}
	}
	sort.Slice(imgs, func(i, j int) bool { return imgs[i].at.After(imgs[j].at) })
	seen := map[casstore.Hash]bool{}
	var out []casstore.Hash
	for _, im := range imgs {
		if len(out) == n {
			break
		}
		b, err := os.ReadFile(c.path(im.key, ".json"))
		var m meta
		if err != nil || json.Unmarshal(b, &m) != nil || m.Root.IsZero() || seen[m.Root] {
			continue
		}
		seen[m.Root] = true
		out = append(out, m.Root)
	}
	return out
}

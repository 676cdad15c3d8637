package kview

import (
	"context"
	"io"

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
// build verifies them. Then it lays out the most recent root's image once, written
// nowhere, so that the first build's working memory (scratch.go) is faulted in
// before a container waits for it.

// WarmTrees decodes into the memo the trees of the roots of the most recently used
// images found when the cache opened (loadRecords), up to roots distinct roots and
// half the memo's size (a warm-up never evicts what it loaded). It returns how many
// tree objects it read. Trees whose objects have gone are skipped: a warm-up only
// saves time. Then it faults in a build's scratch (warmScratch).
func (c *Cache) WarmTrees(ctx context.Context, roots int) (int, error) {
	n := 0
	for _, root := range c.lastRoots[:min(roots, len(c.lastRoots))] {
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
	if len(c.lastRoots) > 0 && roots > 0 {
		c.warmScratch(ctx, c.lastRoots[0])
	}
	return n, nil
}

// warmScratch lays out root's image in a kept scratch and writes it nowhere: the
// pages a build of that size works in are then the process's. Errors are ignored (a
// warm-up only saves time).
func (c *Cache) warmScratch(ctx context.Context, root casstore.Hash) {
	sc := c.scratch.get()
	defer c.scratch.put(sc)
	if t, err := scan(ctx, c.store, Spec{Root: root}, c.memo, sc); err == nil {
		_, _ = t.writeImage(io.Discard, sc)
	}
}

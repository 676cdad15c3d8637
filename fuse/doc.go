// Package fuse serves lazy, read-only FUSE views of source forks: one root hash from
// the content-addressed store, placed under a workdir prefix so that, as the top
// lower layer of a kernel overlay, the fork merges with the image's own directory.
//
// Nothing is read at mount: a directory's tree object is decoded when the directory
// is first looked up or listed, and a file's blob is opened (verified once per
// process) when the file is opened. Objects are immutable, so the kernel may cache
// entries, attributes, listings and pages for a long time, and FUSE passthrough hands
// reads of a local blob straight to the blob file (whose page cache every view of
// the same root then shares). Alternatively (Options.NoOpen) the kernel opens files
// without asking and keeps each file's pages in the view's own cache, trading
// passthrough and a shared page cache for no round trip per open. Objects missing
// locally come from a BlobSource, fetched once, verified and stored before they are
// served. A missing or corrupt object costs one file or directory (EIO, a log line,
// a counter), never the view.
//
// A view can be mounted unbound and bound later (warm pools): until Bind its root is
// empty, and a look at the workdir before then taints the view.
//
// Each view is its own mount with its own FUSE server (one /dev/fuse connection).
// Views come and go independently (a busy or broken view never holds up the
// others), each is one line in the mount table (fstype fuse.tidepool) for crash
// cleanup, an overlay's lowerdir names the view's mountpoint directly, and a View
// needs nothing from whoever hosts it: the later process that outlives tidepoold can
// host the same views unchanged. The cost is a few goroutines and one small read
// buffer per view.
package fuse

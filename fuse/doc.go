// Package fuse serves lazy, read-only FUSE views of source forks: one root hash from
// the content-addressed store, placed under a workdir prefix so that, as the top
// lower layer of a kernel overlay, the fork merges with the image's own directory.
//
// Nothing is read at mount: a directory's tree object is decoded when the directory
// is first looked up or listed, and a file's blob is opened (verified once per
// process) when the file is opened. Objects are immutable, so the kernel may cache
// entries, attributes and pages for a long time, and FUSE passthrough hands reads of
// a local blob straight to the blob file. Objects missing locally come from a
// BlobSource, fetched once, verified and stored before they are served.
//
// A view can be mounted unbound and bound later (warm pools): until Bind its root is
// empty, and a look at the workdir before then taints the view.
//
// Each view is its own FUSE mount and server, so views come and go independently,
// show up one by one in the mount table (fstype fuse.tidepool) for crash cleanup,
// and a View needs nothing from whoever hosts it.
package fuse

// Package kview serves fork views with the kernel alone: a tree (root, prefix, owner)
// becomes a metadata-only EROFS image in which every non-empty regular file is an
// all-holes inode of the right size carrying the overlayfs xattrs
// trusted.overlay.metacopy and trusted.overlay.redirect=/<hh>/<62 hex>, the path of
// its object in the store. An overlay mount with that image as its lower layer and
// the object directory as a data-only lower layer (kernel >= 6.5; EROFS mounts a file
// directly on >= 6.12) then shows the tree with file data read straight from the
// objects: no process in the read path, so reads run at native speed and the view
// keeps working while tidepoold restarts.
//
// MountImage mounts an image alone instead, for an overlay that layers it directly (the
// container's own overlay, with the object directory as its data-only layer): one
// overlay fewer in every lookup and read. Such a mount is found in the mount table by
// its source, the image's path (KEY.erofs).
//
// Images are cached under a directory keyed by (root, prefix, owner), built once per
// key (single-flight) and removed by Collect when no mounted view uses them. A build
// is on a container's create path, so it is kept cheap: tree objects are read by
// several workers and remembered decoded for later builds (trees never change; a new
// process decodes those of the roots its images showed last, warm.go), file
// sizes come from the store's size index (casstore.Store.KnownSize) with a stat only
// where it has no entry, and the image is laid out in memory straight from the
// scanned tree by this package's own writer (erofs.go; its output is byte for byte
// what go-erofs writes for the same tree, which the tests check) and written once,
// its writeback started at once. The image of a cached tree for another owner of the
// same class (both owners fitting 16 bits, or neither) is derived instead: the same
// layout with the owned inodes' owner rewritten where the first build recorded them
// (derive.go). Host.Prebuild lets a caller start a build before it
// mounts (the snapshotter does, as soon as it knows a fork's root). A mount first asks
// the kernel to read the whole image (EROFS reads a file-backed image's metadata one
// block at a time, each a synchronous read, with no readahead); if the image was not
// in the page cache, a sign of cold caches, the host also reads ahead the data of the
// view's files in the background, in tree order, up to Host.ColdReadAhead bytes
// (coldread.go). Mounted views are
// found again after a restart from the mount table: the overlay's source names the
// image key ("tidepool-kview:<key>").
//
// Nothing verifies object bytes at read time on this path (no fs-verity): objects are
// verified when they enter the store, and the view only ever points at objects of
// the store's own layout.
package kview

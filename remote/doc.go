// Package remote shares roots and refs between hosts through an S3-compatible object
// store (AWS S3, Cloudflare R2, MinIO, Ceph RGW) in LunarFS's server layout, so no
// server of Tidepool's own is needed and a LunarFS server pointed at the same bucket
// (`lunar serve --store s3://BUCKET`) serves the same data:
//
//	PREFIX/blobs/<hh>/<62 hex>   an object's raw bytes; BLAKE3 of the bytes is the name
//	PREFIX/ref/<name>            a ref: exactly {"root":"<64 hex>"}
//	PREFIX/ref/<name>@conflict-<8 hex>  the loser's root of a rejected compare-and-swap
//
// Push uploads children before parents, so a tree present in the bucket implies its
// whole subtree is: a push skips every subtree the bucket already holds, and diffs
// against the ref's current root (known complete) so that a commit that changed ten
// files costs requests proportional to the changed path components, not the tree.
// Refs move by a real compare-and-swap: S3 conditional writes (If-Match on the ref's
// ETag to update, If-None-Match: * to create). Objects are uploaded before any ref
// write, so a ref, won or lost, never names an incomplete root.
//
// Beside that layout (a LunarFS server ignores the extra keys) a push also writes one
// pack, PREFIX/packs/<root hex>: a self-describing stream (format version, the root,
// the base root it was diffed against, then hash, length and bytes per entry, parents
// first) of exactly the objects that push uploaded. It exists for speed alone: one
// GET per object of ~10 KB caps a full pull at a few thousand objects a second,
// whatever the bandwidth, while a pack streams at the bandwidth. The blobs stay the
// truth; pack.go has the format.
//
// Pull walks the root through the local store to see what is missing. When that is
// much, it streams the root's pack and then, while objects are still missing, the
// packs of the base roots (at most maxPackChain), storing the entries the walk needs;
// whatever is left (no pack, a bucket LunarFS wrote, a corrupt or truncated pack,
// objects other pushes uploaded) is fetched object by object, in parallel. Every
// object is hashed before it is staged; a mismatch is refused, counted and never
// stored (a bad pack entry is then fetched on its own, and a pack that cannot be read
// on is logged and counted, never failing the pull). Objects land through the
// store's batches (temp file, one sync per batch, rename), published by a committer
// while the pull stages the next batch, so an interrupted pull leaves only whole
// objects and a re-run fetches just the rest.
//
// The S3 client is minio-go v7 rather than the AWS SDK for Go v2: it is one module
// with a small dependency tree (the SDK is a dozen modules plus smithy), it speaks
// path-style requests to custom endpoints out of the box (MinIO, RGW, R2), it exposes
// the conditional-write headers as first-class options, and it is maintained and
// tested against AWS S3 and MinIO alike. No request signing is written here.
package remote

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
// the base root it was diffed against, then per entry its hash, size and bytes, raw
// or as one LZ4 block when that is smaller, parents first) of exactly the objects
// that push uploaded. It exists for speed alone: one GET per object of ~10 KB caps a
// full pull at a few thousand objects a second, whatever the bandwidth, while a pack
// streams at the bandwidth; and since a durable pull must write what it receives to
// disk before it returns, compressed entries (a source tree packs to ~40% of its
// size) halve what the pull moves and syncs. The blobs stay the truth; pack.go has
// the format.
//
// Pull walks the root through the local store to see what is missing (into an empty
// store, everything, without asking per object). When that is much, it streams the
// root's pack and then, while objects are still missing, the packs of the base roots
// (at most maxPackChain), storing the entries the walk needs; whatever is left (no
// pack, a bucket LunarFS wrote, a corrupt or truncated pack, objects other pushes
// uploaded) is fetched object by object, in parallel. A pack is read in 4 MiB slabs
// straight from the connection; trees are verified and walked at once, and the
// wanted blobs of each slab go as one batch to a writer (one per CPU), which decodes
// and hashes each, then appends the good ones where they lie to one store journal
// (casstore.JournalWriter.PutAllExpect: vectored writes, no copy) while the reader
// streams on. Every object is hashed before it is journaled; a mismatch (or a block
// that does not decode) is refused, counted and never stored (a bad pack entry is
// then fetched on its own, and a pack that cannot be read on is logged and counted,
// never failing the pull). The journal syncs in the background as it grows and once
// at the end, so when Pull returns the root is durable and readable through the
// store; its objects reach their LunarFS names in the background. An interrupted
// pull leaves only whole objects (a dead pull's journal is replayed up to its torn
// tail) and a re-run fetches just the rest.
//
// The S3 client is minio-go v7 rather than the AWS SDK for Go v2: it is one module
// with a small dependency tree (the SDK is a dozen modules plus smithy), it speaks
// path-style requests to custom endpoints out of the box (MinIO, RGW, R2), it exposes
// the conditional-write headers as first-class options, and it is maintained and
// tested against AWS S3 and MinIO alike. No request signing is written here.
package remote

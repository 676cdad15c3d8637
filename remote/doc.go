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
// Pull fetches what the local store lacks in parallel and hashes every byte before it
// is staged; a mismatch is refused, counted and never stored. Objects land through the
// store's batches (temp file, fsync, rename), so an interrupted pull leaves only whole
// objects and a re-run fetches just the rest.
//
// The S3 client is minio-go v7 rather than the AWS SDK for Go v2: it is one module
// with a small dependency tree (the SDK is a dozen modules plus smithy), it speaks
// path-style requests to custom endpoints out of the box (MinIO, RGW, R2), it exposes
// the conditional-write headers as first-class options, and it is maintained and
// tested against AWS S3 and MinIO alike. No request signing is written here.
package remote

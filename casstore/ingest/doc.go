// Package ingest turns directories into casstore roots. Dir hashes a whole directory
// tree by LunarFS's rules (so a --lunar-strict root is byte-identical to what `lunar
// ingest` prints); Upper commits the changes an overlayfs upper directory holds on top
// of a base root, touching only what changed, so committing a container's edits costs
// O(changed) instead of a full re-walk. Both write through one casstore.Batch: a failed
// or cancelled ingest leaves the store's set of objects unchanged.
//
// The invariant that ties the two together: for a base root made by Dir (or Upper)
// with the same Options, Upper(base, upper, prefix) equals Dir of the overlay's merged
// view under prefix.
package ingest

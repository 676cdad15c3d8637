// Package casstore is Tidepool's content-addressed object store: source trees live
// here as BLAKE3-addressed blobs and tree objects, byte-compatible with LunarFS, so a
// fork is a 32-byte root hash and a root made by either tool is usable by the other.
//
// The on-disk layout is LunarFS's client CAS (<root>/<hh>/<62 hex>, raw bytes, no
// header). Tidepool adds what LunarFS lacks: streaming writes with unique temp files,
// fsync and rename, verification of every object before it is served, a lock that
// keeps garbage collection from racing writers, and a strict tree codec.
package casstore

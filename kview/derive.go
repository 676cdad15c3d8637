package kview

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// This file derives the image of a tree for one owner from its image for another.
//
// An image's owner sits only in the uid and gid fields of its owned inodes (the
// workdir's parent directories belong to 0:0 whoever owns the tree). Whether an inode
// is compact (16-bit owner) or extended (32-bit) depends on its owner, link count and
// size; two owners that both fit in 16 bits, or both do not, thus give every inode
// the same format, so the two images have the same layout and differ in those fields
// only. A view of a cached tree for a new owner (a container running as another user,
// another pool's members) then costs a copy of the image with its owner rewritten
// instead of a scan of every tree object: the build writes, beside each image, where
// its owned inodes are (its owner slots), and a derivation checks each slot's inode
// (format and current owner) before it rewrites it. The tests check that a derived
// image is byte for byte the image a build writes.

// errOwnerClass: the two owners give different layouts.
var errOwnerClass = errors.New("owners need different inode formats")

// slotCompact marks an owner slot whose inode is compact (offsets are multiples of 32).
const slotCompact = 1

// ownerFits16 reports whether an owner fits compact inodes.
func ownerFits16(uid, gid uint32) bool { return uid <= 0xffff && gid <= 0xffff }

// ownerSlots lists the image's owned inodes, 8 bytes each (little endian): the
// inode's byte offset in the image, with slotCompact set for a compact inode.
func (l *imageLayout) ownerSlots() []byte {
	meta := uint64(l.metaBlk) * erofsBlockSize
	out := make([]byte, 0, 8*len(l.nodes))
	for i := range l.nodes {
		e := &l.nodes[i]
		if !e.n.owned {
			continue
		}
		v := meta + e.nid*32
		if e.compact {
			v |= slotCompact
		}
		out = binary.LittleEndian.AppendUint64(out, v)
	}
	return out
}

// deriveImage rewrites, in img, the owner of every inode slots lists from (fromUID,
// fromGID) to (uid, gid). It refuses owners of different inode formats, and slots that
// do not match the image (out of range, another format, another owner); img is then
// partly rewritten and must be dropped.
func deriveImage(img, slots []byte, fromUID, fromGID, uid, gid uint32) error {
	if ownerFits16(fromUID, fromGID) != ownerFits16(uid, gid) {
		return errOwnerClass
	}
	if len(slots)%8 != 0 {
		return fmt.Errorf("owner slots: %d bytes is not a whole number of slots", len(slots))
	}
	le := binary.LittleEndian
	for i := 0; i < len(slots); i += 8 {
		v := le.Uint64(slots[i:])
		off, compact := v&^slotCompact, v&slotCompact != 0
		size := uint64(erofsExtended)
		if compact {
			size = erofsCompact
		}
		if off%32 != 0 || off > uint64(len(img)) || uint64(len(img))-off < size {
			return fmt.Errorf("owner slot %d: offset %d outside the image (%d bytes)", i/8, off, len(img))
		}
		ib := img[off : off+size]
		if extended := le.Uint16(ib[0:])&1 == 1; extended == compact {
			return fmt.Errorf("owner slot %d: the inode at %d is not of the recorded format", i/8, off)
		}
		if compact {
			if uint32(le.Uint16(ib[24:])) != fromUID || uint32(le.Uint16(ib[26:])) != fromGID {
				return fmt.Errorf("owner slot %d: the inode at %d is not owned by %d:%d", i/8, off, fromUID, fromGID)
			}
			le.PutUint16(ib[24:], uint16(uid))
			le.PutUint16(ib[26:], uint16(gid))
			continue
		}
		if le.Uint32(ib[24:]) != fromUID || le.Uint32(ib[28:]) != fromGID {
			return fmt.Errorf("owner slot %d: the inode at %d is not owned by %d:%d", i/8, off, fromUID, fromGID)
		}
		le.PutUint32(ib[24:], uid)
		le.PutUint32(ib[28:], gid)
	}
	return nil
}

package hostcheck

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// filesystems names the statfs magics a root is commonly on.
var filesystems = map[int64]string{
	unix.TMPFS_MAGIC:           "tmpfs",
	unix.OVERLAYFS_SUPER_MAGIC: "overlayfs",
	unix.RAMFS_MAGIC:           "ramfs",
	unix.EXT4_SUPER_MAGIC:      "ext4",
	unix.XFS_SUPER_MAGIC:       "xfs",
	unix.BTRFS_SUPER_MAGIC:     "btrfs",
	unix.FUSE_SUPER_MAGIC:      "fuse",
	unix.NFS_SUPER_MAGIC:       "nfs",
}

// noFileBackedEROFS are filesystems EROFS cannot mount an image file from (seen on
// 6.18: "block device required"): EROFS reads the image through the file's page
// cache operations, which shmem and overlayfs files do not offer.
var noFileBackedEROFS = map[int64]bool{unix.TMPFS_MAGIC: true, unix.OVERLAYFS_SUPER_MAGIC: true}

// filesystemOf returns the name (or magic) of the filesystem holding path, and its
// magic; "" and 0 if statfs fails.
func filesystemOf(path string) (string, int64) {
	var st unix.Statfs_t
	if unix.Statfs(path, &st) != nil {
		return "", 0
	}
	if name, ok := filesystems[st.Type]; ok {
		return name, st.Type
	}
	return fmt.Sprintf("filesystem magic %#x", st.Type), st.Type
}

package hostcheck

import (
	"bufio"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// probeImage is a 4 KiB EROFS image holding one file, "probe", whose content is
// probeData. Made once with erofs-utils 1.5 (reproducible: fixed time, uuid, owner):
//
//	printf tidepool > src/probe
//	mkfs.erofs -T0 -U00000000-0000-0000-0000-000000000000 --force-uid=0 --force-gid=0 probe.erofs src
//
// Embedding it keeps the probe free of mkfs.erofs on the hosts being checked.
//
//go:embed probe.erofs
var probeImage []byte

// EROFS mounts the embedded image straight from a regular file (no loop device,
// kernel >= 6.12 with CONFIG_EROFS_FS_BACKED_BY_FILE) and reads its file back. The
// image file lives under root, where kernel views keep theirs: the backing file's
// filesystem must be able to read folios (ext4, xfs, btrfs; not tmpfs, which fails
// with "block device required").
func EROFS(_ context.Context, root string, k KernelVersion) Check {
	c := Check{Name: "erofs file-backed mounts",
		Fix: "kernel views need kernel >= " + erofsFile + " with CONFIG_EROFS_FS and CONFIG_EROFS_FS_BACKED_BY_FILE (modprobe erofs if it is a module); until then views are served by FUSE"}
	fsKnown := filesystemListed("erofs")
	if !fsKnown && !moduleAvailable(k, "fs/erofs") {
		return failed(c, Missing, fmt.Errorf("erofs is neither in /proc/filesystems nor a module of kernel %s", k.Release))
	}
	s, err := newScratch()
	if err != nil {
		return notProbed(c, err)
	}
	defer s.close()
	root, err = probeDir(root)
	if err != nil {
		return failed(c, Degraded, err)
	}
	f, err := os.CreateTemp(root, ".hostcheck-erofs-")
	if err != nil {
		return failed(c, Degraded, err)
	}
	img := f.Name()
	defer os.Remove(img)
	_, err = f.Write(probeImage)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return failed(c, Degraded, err)
	}
	if err := s.mkdirs("m"); err != nil {
		return failed(c, Degraded, err)
	}
	if err := s.mount(img, s.path("m"), "erofs", unix.MS_RDONLY, ""); err != nil {
		fs, magic := filesystemOf(root)
		why := "file-backed mounts need >= " + erofsFile
		switch {
		case errors.Is(err, unix.ENODEV):
			why = "the erofs module did not load"
		case errors.Is(err, unix.ENOTBLK) && k.atLeast(erofsFile) && noFileBackedEROFS[magic]:
			// The kernel has file-backed EROFS; the root's filesystem cannot back it.
			c.Fix = fmt.Sprintf("put the root on a disk filesystem (ext4, xfs, btrfs), not %s; until then views are served by FUSE", fs)
			why = fmt.Sprintf("the root %s is on %s, which cannot back an EROFS image file", root, fs)
		case errors.Is(err, unix.ENOTBLK) && k.atLeast(erofsFile):
			why = fmt.Sprintf("this kernel lacks CONFIG_EROFS_FS_BACKED_BY_FILE, or the root's filesystem (%s) cannot back an image file", fs)
		}
		return failed(c, Missing, fmt.Errorf("%w (kernel %s; %s)", err, k.Release, why))
	}
	got, err := os.ReadFile(s.path("m/probe"))
	if err != nil {
		return failed(c, Missing, fmt.Errorf("read from the probe image: %w", err))
	}
	if string(got) != probeData {
		return failed(c, Missing, fmt.Errorf("probe image read %q, want %q", got, probeData))
	}
	return ok(c.Name, "an EROFS image mounts from a regular file")
}

// filesystemListed reports whether /proc/filesystems names fstype.
func filesystemListed(fstype string) bool {
	f, err := os.Open("/proc/filesystems")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 0 && fields[len(fields)-1] == fstype {
			return true
		}
	}
	return false
}

// moduleAvailable reports whether the running kernel ships the module under
// kernel/<rel> (e.g. fs/erofs), so mounting would load it.
func moduleAvailable(k KernelVersion, rel string) bool {
	matches, _ := filepath.Glob(filepath.Join("/lib/modules", k.Release, "kernel", rel, "*.ko*"))
	return len(matches) > 0
}

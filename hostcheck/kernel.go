package hostcheck

import (
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// KernelVersion is the running kernel's release, parsed.
type KernelVersion struct {
	Release      string // uname -r
	Major, Minor int
}

// Kernel reads the running kernel's release with uname(2).
func Kernel() KernelVersion {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return KernelVersion{Release: "unknown: " + err.Error()}
	}
	return ParseKernel(unix.ByteSliceToString(u.Release[:]))
}

// ParseKernel parses a release such as "6.18.44-fc-v769"; unparsable parts stay 0.
func ParseKernel(release string) KernelVersion {
	k := KernelVersion{Release: release}
	parts := strings.SplitN(release, ".", 3)
	if len(parts) >= 2 {
		k.Major, _ = strconv.Atoi(parts[0])
		minor := parts[1]
		if i := strings.IndexFunc(minor, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
			minor = minor[:i]
		}
		k.Minor, _ = strconv.Atoi(minor)
	}
	return k
}

// AtLeast reports whether the kernel is major.minor or newer.
func (k KernelVersion) AtLeast(major, minor int) bool {
	return k.Major > major || (k.Major == major && k.Minor >= minor)
}

// Kernel versions the features arrived in (mainline).
const (
	dataOnlyLowers = "6.5"  // overlayfs lowerdir=a::b
	fuseBacking    = "6.9"  // FUSE passthrough
	erofsFile      = "6.12" // EROFS mounted directly from a regular file
)

func (k KernelVersion) atLeast(v string) bool {
	kv := ParseKernel(v)
	return k.AtLeast(kv.Major, kv.Minor)
}

// Check reports the kernel release; older than the oldest kernel-view feature is
// degraded (FUSE views still work).
func (k KernelVersion) Check() Check {
	c := Check{Name: "kernel", Detail: k.Release}
	switch {
	case k.Major == 0:
		c.Status, c.Fix = Degraded, "could not read the kernel release"
	case !k.atLeast(erofsFile):
		c.Status = Degraded
		c.Detail = fmt.Sprintf("%s: kernel views need >= %s (data-only lowers %s, FUSE passthrough %s, file-backed EROFS %s); FUSE views work", k.Release, erofsFile, dataOnlyLowers, fuseBacking, erofsFile)
		c.Fix = "boot a kernel >= " + erofsFile
	default:
		c.Status = OK
	}
	return c
}

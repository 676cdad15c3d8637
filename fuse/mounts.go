package fuse

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// mountInfo is one line of /proc/self/mountinfo, reduced to what cleanup needs.
type mountInfo struct {
	point  string
	fstype string
}

const mountinfoPath = "/proc/self/mountinfo"

func readMountinfo() ([]mountInfo, error) {
	f, err := os.Open(mountinfoPath)
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	var out []mountInfo
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if m, ok := parseMountinfoLine(sc.Text()); ok {
			out = append(out, m)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	return out, nil
}

// parseMountinfoLine reads "id parent maj:min root mountpoint opts [optional...] -
// fstype source superopts" (proc(5)); the mountpoint is octal-escaped.
func parseMountinfoLine(line string) (mountInfo, bool) {
	fields := strings.Fields(line)
	sep := -1
	for i := 6; i < len(fields); i++ {
		if fields[i] == "-" {
			sep = i
			break
		}
	}
	if len(fields) < 5 || sep < 0 || sep+1 >= len(fields) {
		return mountInfo{}, false
	}
	return mountInfo{point: unescapeOctal(fields[4]), fstype: fields[sep+1]}, true
}

// unescapeOctal undoes the kernel's \NNN escaping of space, tab, newline and '\'.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// resolveDir makes dir absolute and resolves symlinks in its parent only: the
// directory itself may be a dead FUSE mount that cannot be stat'ed (ENOTCONN).
func resolveDir(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if abs == "/" {
		return abs, nil
	}
	parent, err := filepath.EvalSymlinks(filepath.Dir(abs))
	if err != nil {
		return "", err
	}
	return filepath.Join(parent, filepath.Base(abs)), nil
}

// Mounts lists the views mounted at or below under (fstype fuse.tidepool), sorted so
// that a mount comes after any mount below it: unmounting in order never meets a
// busy parent. A daemon calls it at start to clean up after a crash.
func Mounts(under string) ([]string, error) {
	base, err := resolveDir(under)
	if err != nil {
		return nil, fmt.Errorf("list views under %s: %w", under, err)
	}
	all, err := readMountinfo()
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var out []string
	for _, m := range all {
		if m.fstype != FsType || seen[m.point] || !within(base, m.point) {
			continue
		}
		seen[m.point] = true
		out = append(out, m.point)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] > out[j] })
	return out, nil
}

func within(base, p string) bool {
	if base == "/" || p == base {
		return true
	}
	return strings.HasPrefix(p, base+"/")
}

// topMount returns the fstype of the topmost mount at point, or "" if none.
func topMount(point string) (string, error) {
	all, err := readMountinfo()
	if err != nil {
		return "", err
	}
	top := ""
	for _, m := range all {
		if m.point == point {
			top = m.fstype // later lines are mounted on top of earlier ones
		}
	}
	return top, nil
}

// UnmountStale detaches the view mounted at dir lazily (MNT_DETACH), so that a
// mountpoint whose server died (every access fails with ENOTCONN) or that a crashed
// daemon left behind can be reused at once. Every view stacked at dir goes. A dir
// with no mount is fine; a dir where something other than a view is mounted is an
// error and is left alone.
func UnmountStale(dir string) error {
	return unmountOurs(dir, unix.MNT_DETACH)
}

// UnmountDir unmounts the view at dir (served by any process), without detaching: it
// fails with an error wrapping errdefs.ErrFailedPrecondition while the view is busy
// and with errdefs.ErrNotFound if no view is mounted there. The serving process
// notices and exits.
func UnmountDir(dir string) error {
	p, err := resolveDir(dir)
	if err != nil {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	top, err := topMount(p)
	if err != nil {
		return err
	}
	if top != FsType {
		return fmt.Errorf("unmount %s: no tidepool view is mounted there: %w", p, errdefs.ErrNotFound)
	}
	return unmountOurs(p, 0)
}

func unmountOurs(dir string, flags int) error {
	p, err := resolveDir(dir)
	if err != nil {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	// Views can be stacked at one point; each pass removes the topmost. The bound
	// guards against a table that does not change (which would be a kernel oddity).
	for range 64 {
		top, err := topMount(p)
		if err != nil {
			return err
		}
		switch top {
		case "":
			return nil
		case FsType:
		default:
			return fmt.Errorf("unmount %s: %s is mounted there, not a tidepool view: %w", p, top, errdefs.ErrFailedPrecondition)
		}
		err = unix.Unmount(p, flags)
		switch {
		case err == nil, errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			// Done, or unmounted meanwhile: look again.
		case errors.Is(err, unix.EBUSY):
			return fmt.Errorf("unmount %s: %w: %w", p, err, errdefs.ErrFailedPrecondition)
		default:
			return fmt.Errorf("unmount %s: %w", p, err)
		}
	}
	return fmt.Errorf("unmount %s: views are still mounted there", p)
}

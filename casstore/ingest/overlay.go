package ingest

import (
	"bytes"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Overlayfs keeps its metadata in xattrs named overlay.<what>, in the trusted.
// namespace normally and in user. when the overlay is mounted with userxattr.
var ovlPrefixes = []string{"trusted.overlay.", "user.overlay."}

// ovlAttrs is what Upper needs to know about one upper entry's overlay xattrs.
type ovlAttrs struct {
	opaque   bool   // overlay.opaque = "y": the directory hides everything below it ("x" only marks xattr whiteouts inside)
	whiteout bool   // overlay.whiteout: with a zero-size regular file, the newer xattr form of a whiteout
	metacopy bool   // overlay.metacopy: metadata-only copy-up, the data is the lower file's
	redirect bool   // overlay.redirect: the entry stands for a lower entry at another path
	target   string // the redirect's value: a name in the same lower directory, or "/"+path from the layer root
}

// overlayAttrs reads the overlay xattrs of path (without following a symlink). A
// filesystem without xattr support simply has none.
func overlayAttrs(path string) (ovlAttrs, error) {
	var a ovlAttrs
	names, err := listXattrs(path)
	if err != nil {
		return a, err
	}
	for _, name := range bytes.Split(names, []byte{0}) {
		for _, p := range ovlPrefixes {
			what, ok := bytes.CutPrefix(name, []byte(p))
			if !ok {
				continue
			}
			switch string(what) {
			case "whiteout":
				a.whiteout = true
			case "metacopy":
				a.metacopy = true
			case "redirect":
				v, err := getXattr(path, string(name))
				if err != nil {
					return a, err
				}
				a.redirect, a.target = true, string(v)
			case "opaque":
				v, err := getXattr(path, string(name))
				if err != nil {
					return a, err
				}
				if string(v) == "y" {
					a.opaque = true
				}
			}
		}
	}
	return a, nil
}

func listXattrs(path string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Llistxattr(path, buf)
		switch {
		case err == nil:
			return buf[:n], nil
		case errors.Is(err, unix.ERANGE):
			sz, err := unix.Llistxattr(path, nil)
			if err != nil {
				return nil, fmt.Errorf("list xattrs of %s: %w", path, err)
			}
			buf = make([]byte, sz+64)
		case errors.Is(err, unix.ENOTSUP):
			return nil, nil
		default:
			return nil, fmt.Errorf("list xattrs of %s: %w", path, err)
		}
	}
}

func getXattr(path, name string) ([]byte, error) {
	buf := make([]byte, 64)
	for {
		n, err := unix.Lgetxattr(path, name, buf)
		switch {
		case err == nil:
			return buf[:n], nil
		case errors.Is(err, unix.ERANGE):
			sz, err := unix.Lgetxattr(path, name, nil)
			if err != nil {
				return nil, fmt.Errorf("read xattr %s of %s: %w", name, path, err)
			}
			buf = make([]byte, sz+16)
		case errors.Is(err, unix.ENODATA):
			return nil, nil
		default:
			return nil, fmt.Errorf("read xattr %s of %s: %w", name, path, err)
		}
	}
}

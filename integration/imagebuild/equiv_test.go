package imagebuild

// One-off equivalence check (issue 15): unpack every image the tests use with
// containerd's own applier and list the rootfs; run against the old and the new
// builder and diff the listings.

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
)

func TestEquivalenceListing(t *testing.T) {
	out := os.Getenv("IMAGEBUILD_LISTING_DIR")
	if out == "" || os.Getuid() != 0 {
		t.Skip("set IMAGEBUILD_LISTING_DIR and run as root")
	}
	host := t.TempDir()
	must(t, os.Chmod(host, 0o711))
	must(t, os.MkdirAll(filepath.Join(host, "sub", "deep"), 0o750))
	must(t, os.WriteFile(filepath.Join(host, "a.txt"), []byte("alpha"), 0o640))
	must(t, os.WriteFile(filepath.Join(host, "sub", "deep", "tool"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Symlink("../a.txt", filepath.Join(host, "sub", "link")))
	unit := Spec{Layers: []Layer{
		{File("/etc/motd", []byte("hello\n"), 0), File("/usr/bin/su", []byte("suid"), 0o755|fs.ModeSetuid),
			Dir("/tmp", 0o777|fs.ModeSticky), Symlink("/bin/sh", "busybox"),
			HostFile("/opt/a.txt", filepath.Join(host, "a.txt")).Owner(1000, 1001), HostDir("/srv/tree", host).Owner(7, 8),
			Dir("/gone", 0o700), File("/gone/f", []byte("f"), 0)},
		{Whiteout("/etc/motd"), Whiteout("/gone"), File("/tmp/x", nil, 0o600), File("/gone/g", nil, 0o600).Owner(3, 3)},
	}}
	cache := t.TempDir()
	archives := map[string]string{
		"busybox": BusyboxArchive(t).Path,
		"node":    NodeArchive(t).Path,
		"pause":   PauseArchive(t).Path,
	}
	stamp, err := Node(context.Background())
	must(t, err)
	stamp.Layers = append(stamp.Layers, Layer{HostFile("/usr/local/bin/stamp", "/bin/busybox")})
	for name, s := range map[string]Spec{"stamp": stamp, "unit": unit, "unit-gzip": {Layers: unit.Layers, Gzip: true}} {
		a, err := Cached(s, cache)
		must(t, err)
		archives[name] = a.Path
	}
	for name, p := range archives {
		listing := unpackListing(t, p)
		must(t, os.WriteFile(filepath.Join(out, name+".txt"), []byte(listing), 0o644))
	}
}

func unpackListing(t *testing.T, archivePath string) string {
	data, err := os.ReadFile(archivePath)
	must(t, err)
	files := map[string][]byte{}
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		b, _ := io.ReadAll(tr)
		files[h.Name] = b
	}
	blob := func(d string) []byte { return files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")] }
	var index, manifest struct {
		Manifests []struct{ Digest string } `json:"manifests"`
		Layers    []struct{ Digest string } `json:"layers"`
		Config    struct{ Digest string }   `json:"config"`
	}
	must(t, json.Unmarshal(files["index.json"], &index))
	must(t, json.Unmarshal(blob(index.Manifests[0].Digest), &manifest))
	var cfg struct {
		Config json.RawMessage `json:"config"`
		RootFS json.RawMessage `json:"rootfs"`
		OS     string          `json:"os"`
		Arch   string          `json:"architecture"`
	}
	must(t, json.Unmarshal(blob(manifest.Config.Digest), &cfg))
	root := t.TempDir()
	for _, l := range manifest.Layers {
		r, err := compression.DecompressStream(bytes.NewReader(blob(l.Digest)))
		must(t, err)
		_, err = archive.Apply(context.Background(), root, r)
		must(t, err)
		r.Close()
	}
	var lines []string
	lines = append(lines, fmt.Sprintf("config %s rootfs %s %s/%s", cfg.Config, cfg.RootFS, cfg.OS, cfg.Arch))
	must(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		rel, _ := filepath.Rel(root, p)
		line := fmt.Sprintf("%s %v %o %d:%d nlink=%d size=%d", rel, fi.Mode(), st.Mode, st.Uid, st.Gid, st.Nlink, fi.Size())
		if !fi.IsDir() {
			line += fmt.Sprintf(" mtime=%d", fi.ModTime().Unix())
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			line += " -> " + target
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" sha256=%x", sha256.Sum256(b))
		}
		lines = append(lines, line)
		return nil
	}))
	sort.Strings(lines)
	return strings.Join(lines, "\n") + "\n"
}

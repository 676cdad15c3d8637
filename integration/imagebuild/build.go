package imagebuild

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"syscall"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Build writes the OCI image layout archive of spec (oci-layout, index.json and
// blobs/sha256/*) to w and returns the manifest descriptor (its digest names the
// image). Blobs are staged in a content store on disk, so memory use does not
// grow with the image.
func Build(spec Spec, w io.Writer) (ocispec.Descriptor, error) {
	ctx := context.Background()
	tmp, err := os.MkdirTemp("", "imagebuild-")
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: %w", err)
	}
	defer os.RemoveAll(tmp)
	cs, err := local.NewStore(tmp)
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: %w", err)
	}
	manifest := ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, Layers: []ocispec.Descriptor{}}
	image := ocispec.Image{Platform: ocispec.Platform{Architecture: runtime.GOARCH, OS: "linux"},
		Config: spec.Config, RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{}}}
	if len(image.Config.Env) == 0 {
		image.Config.Env = []string{DefaultPath}
	}
	image.Config.WorkingDir = cmp.Or(image.Config.WorkingDir, "/")
	for i, l := range spec.Layers {
		desc, err := store(ctx, cs, ocispec.MediaTypeImageLayer, l)
		if err != nil {
			return ocispec.Descriptor{}, fmt.Errorf("build image: layer %d: %w", i, err)
		}
		// Layers are not compressed, so a blob's digest is its diff ID.
		manifest.Layers, image.RootFS.DiffIDs = append(manifest.Layers, desc), append(image.RootFS.DiffIDs, desc.Digest)
	}
	if manifest.Config, err = store(ctx, cs, ocispec.MediaTypeImageConfig, image); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: config: %w", err)
	}
	desc, err := store(ctx, cs, ocispec.MediaTypeImageManifest, manifest)
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: manifest: %w", err)
	}
	desc.Platform = &image.Platform
	if err := archive.Export(ctx, cs, w, archive.WithManifest(desc), archive.WithSkipDockerManifest()); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: export: %w", err)
	}
	return desc, nil
}

// store writes v into cs as a blob: a Layer as its tar, anything else as JSON.
// The store's writer digests the blob on the way in.
func store(ctx context.Context, cs content.Store, mediaType string, v any) (ocispec.Descriptor, error) {
	cw, err := content.OpenWriter(ctx, cs, content.WithRef("imagebuild"))
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer cw.Close()
	var data []byte
	if l, ok := v.(Layer); ok {
		err = writeLayer(ctx, cw, l)
	} else if data, err = json.Marshal(v); err == nil {
		_, err = cw.Write(data)
	}
	st, serr := cw.Status()
	if err = errors.Join(err, serr); err != nil {
		return ocispec.Descriptor{}, err
	}
	desc := ocispec.Descriptor{MediaType: mediaType, Digest: cw.Digest(), Size: st.Offset}
	if err := cw.Commit(ctx, desc.Size, desc.Digest); err != nil && !errdefs.IsAlreadyExists(err) {
		return desc, err // (two identical layers share one blob)
	}
	return desc, nil
}

// formatVersion changes whenever Build's output for a given Spec changes, so
// archives cached by an older builder are not reused.
const formatVersion = "imagebuild/2"

// Archive is a built image archive on disk.
type Archive struct{ Path string }

// key is a content hash of spec: every field, plus the path, mode, size, mtime,
// inode and link target of each host file it copies. Host file contents are
// not read: a host file replaced or rewritten changes its inode or mtime, and
// hashing a 100 MB node binary on every test run is what the cache is there to avoid.
func key(spec Spec) (string, error) {
	h := sha256.New()
	enc := json.NewEncoder(h)
	err := enc.Encode([]any{formatVersion, spec})
	for _, l := range spec.Layers {
		for _, e := range l {
			if err != nil || e.Kind != KindHost {
				continue
			}
			err = walkHost(e.Source, func(s, _ string, fi fs.FileInfo) error {
				target, _ := os.Readlink(s) // "" unless s is a link
				st, _ := fi.Sys().(*syscall.Stat_t)
				return enc.Encode([]any{s, fi.Mode(), fi.Size(), fi.ModTime().UnixNano(), st.Ino, target})
			})
		}
	}
	if err != nil {
		return "", fmt.Errorf("image key: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Cached returns the archive of spec under the directory dir, building it the
// first time, named by its key.
func Cached(spec Spec, dir string) (Archive, error) {
	key, err := key(spec)
	if err != nil {
		return Archive{}, err
	}
	p, err := cacheEntry(dir, key+".tar", func(tmp string) error {
		f, err := os.Create(tmp)
		if err != nil {
			return err
		}
		_, err = Build(spec, f)
		return errors.Join(err, f.Close())
	})
	return Archive{Path: p}, err
}

// cacheEntry returns dir/name (dir exists), first making it if missing: create
// writes a file or directory at a temporary path that is then renamed into
// place, so nobody sees a half-made entry and concurrent makers are safe.
func cacheEntry(dir, name string, create func(tmp string) error) (string, error) {
	final := filepath.Join(dir, name)
	if _, err := os.Stat(final); err == nil {
		return final, nil
	}
	tmp, err := os.MkdirTemp(dir, "."+name+".tmp-")
	if err != nil {
		return "", fmt.Errorf("cache %s: %w", name, err)
	}
	defer os.RemoveAll(tmp)
	if err := create(filepath.Join(tmp, name)); err != nil {
		return "", fmt.Errorf("cache %s: %w", name, err)
	}
	// Renaming a directory fails if another maker's is already in place: use theirs.
	if err := os.Rename(filepath.Join(tmp, name), final); err != nil {
		if _, serr := os.Stat(final); serr != nil {
			return "", fmt.Errorf("cache %s: %w", name, err)
		}
	}
	return final, nil
}

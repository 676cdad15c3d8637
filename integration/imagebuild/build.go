package imagebuild

import (
	"bytes"
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
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/tidepool-dev/tidepool/integration/testenv"
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
	image := ocispec.Image{Platform: ocispec.Platform{Architecture: cmp.Or(spec.Arch, runtime.GOARCH), OS: "linux"},
		Config: spec.Config, RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{}}}
	if len(image.Config.Env) == 0 {
		image.Config.Env = []string{DefaultPath}
	}
	image.Config.WorkingDir = cmp.Or(image.Config.WorkingDir, "/")
	dirs := map[string]Entry{}
	for i, l := range spec.Layers {
		desc, diffID, err := storeLayer(ctx, cs, fmt.Sprintf("layer-%d", i), l, dirs, spec.Gzip)
		if err != nil {
			return ocispec.Descriptor{}, fmt.Errorf("build image: layer %d: %w", i, err)
		}
		manifest.Layers, image.RootFS.DiffIDs = append(manifest.Layers, desc), append(image.RootFS.DiffIDs, diffID)
	}
	if manifest.Config, err = storeJSON(ctx, cs, ocispec.MediaTypeImageConfig, image); err != nil {
		return ocispec.Descriptor{}, err
	}
	desc, err := storeJSON(ctx, cs, ocispec.MediaTypeImageManifest, manifest)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	desc.Platform = &image.Platform
	if err := archive.Export(ctx, cs, w, archive.WithManifest(desc), archive.WithSkipDockerManifest()); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: export: %w", err)
	}
	return desc, nil
}

// storeLayer writes a layer's tar (gzipped if gz) into the store, hashing the
// tar (the diff ID) on the way; the store's writer digests the blob.
func storeLayer(ctx context.Context, cs content.Store, ref string, l Layer, dirs map[string]Entry, gz bool) (ocispec.Descriptor, digest.Digest, error) {
	desc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer}
	cw, err := content.OpenWriter(ctx, cs, content.WithRef(ref))
	if err != nil {
		return desc, "", err
	}
	defer cw.Close()
	c := compression.Uncompressed
	if gz {
		c, desc.MediaType = compression.Gzip, ocispec.MediaTypeImageLayerGzip
	}
	zw, err := compression.CompressStream(cw, c)
	if err != nil {
		return desc, "", err
	}
	diffID := digest.SHA256.Digester()
	if err := writeLayer(ctx, io.MultiWriter(zw, diffID.Hash()), l, dirs); err != nil {
		return desc, "", err
	}
	if err := zw.Close(); err != nil {
		return desc, "", err
	}
	st, err := cw.Status()
	if err != nil {
		return desc, "", err
	}
	desc.Digest, desc.Size = cw.Digest(), st.Offset
	if err := cw.Commit(ctx, desc.Size, desc.Digest); err != nil && !errdefs.IsAlreadyExists(err) {
		return desc, "", err // (two identical layers share one blob)
	}
	return desc, diffID.Digest(), nil
}

func storeJSON(ctx context.Context, cs content.Store, mediaType string, v any) (ocispec.Descriptor, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("build image: encode %s: %w", mediaType, err)
	}
	desc := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(data), Size: int64(len(data))}
	if err := content.WriteBlob(ctx, cs, mediaType, bytes.NewReader(data), desc); err != nil {
		return desc, fmt.Errorf("build image: store %s: %w", mediaType, err)
	}
	return desc, nil
}

// formatVersion changes whenever Build's output for a given Spec changes, so
// archives cached by an older builder are not reused.
const formatVersion = "imagebuild/2"

// Archive is a built image archive on disk.
type Archive struct{ Path string }

// Key is a content hash of spec: every field, plus for host copies the path,
// size, mtime, inode and mode of each file they read. Host file contents are not
// read: a host file replaced or rewritten changes its inode or mtime, and hashing
// a 100 MB node binary on every test run is what the cache is there to avoid.
func Key(spec Spec) (string, error) {
	h := sha256.New()
	enc := json.NewEncoder(h)
	err := enc.Encode([]any{formatVersion, spec})
	for _, l := range spec.Layers {
		for _, e := range l {
			if err != nil || e.Kind != KindHostFile && e.Kind != KindHostDir {
				continue
			}
			var src string
			if src, err = filepath.EvalSymlinks(e.Source); err != nil {
				break
			}
			err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
				var fi fs.FileInfo
				if err == nil {
					fi, err = d.Info()
				}
				if err != nil {
					return err
				}
				target, _ := os.Readlink(p) // "" unless p is a link
				st, _ := fi.Sys().(*syscall.Stat_t)
				if err := enc.Encode([]any{p, fi.Mode(), fi.Size(), fi.ModTime().UnixNano(), st.Ino, target}); err != nil || e.Kind == KindHostFile {
					return cmp.Or(err, filepath.SkipAll)
				}
				return nil
			})
		}
	}
	if err != nil {
		return "", fmt.Errorf("image key: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Cached returns the archive of spec under dir, building it the first time,
// named by Key. Concurrent builders of one spec are safe: each writes its own
// temporary file and renames it into place.
func Cached(spec Spec, dir string) (Archive, error) {
	key, err := Key(spec)
	if err != nil {
		return Archive{}, err
	}
	a := Archive{Path: filepath.Join(dir, key+".tar")}
	if _, err := os.Stat(a.Path); err == nil {
		return a, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Archive{}, fmt.Errorf("image cache: %w", err)
	}
	f, err := os.CreateTemp(dir, "."+key+".tmp-*")
	if err != nil {
		return Archive{}, fmt.Errorf("image cache: %w", err)
	}
	defer os.Remove(f.Name()) // no-op once renamed
	_, err = Build(spec, f)
	if err = errors.Join(err, f.Close()); err == nil {
		err = errors.Join(os.Chmod(f.Name(), 0o644), os.Rename(f.Name(), a.Path))
	}
	return a, err
}

// DefaultCacheDir is where archives are cached: <repo>/.cache/images, or
// $TIDEPOOL_CACHE_DIR/images.
func DefaultCacheDir() (string, error) { return testenv.CacheDir("images") }

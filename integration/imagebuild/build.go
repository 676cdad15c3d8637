package imagebuild

import (
	"archive/tar"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sort"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Result describes a built image.
type Result struct {
	// Manifest is the descriptor index.json points at; its digest names the image.
	Manifest ocispec.Descriptor `json:"manifest"`
	// Config is the image config descriptor (its digest is the image ID).
	Config ocispec.Descriptor `json:"config"`
	// Layers are the layer blobs, bottom first.
	Layers []ocispec.Descriptor `json:"layers"`
	// DiffIDs are the digests of the uncompressed layer tars (rootfs.diff_ids).
	DiffIDs []digest.Digest `json:"diff_ids"`
}

// blob is one file under blobs/sha256 of the archive.
type blob struct {
	desc ocispec.Descriptor
	data []byte // small JSON blobs
	path string // layer blobs, staged in a temporary file
}

// BuildFile writes the OCI layout archive of spec to dst, atomically (a
// temporary file in the same directory renamed into place).
func BuildFile(spec Spec, dst string) (Result, error) {
	f, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-*")
	if err != nil {
		return Result{}, fmt.Errorf("build image archive: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op once renamed
	res, err := Build(spec, f)
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("build image archive: %w", cerr)
	}
	if err != nil {
		return Result{}, err
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return Result{}, fmt.Errorf("build image archive: %w", err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		return Result{}, fmt.Errorf("build image archive: %w", err)
	}
	return res, nil
}

// Build writes the OCI image layout archive of spec (a tar holding oci-layout,
// index.json and blobs/sha256/*) to w. Layers are staged in temporary files, so
// memory use does not grow with the image.
func Build(spec Spec, w io.Writer) (Result, error) {
	tmp, err := os.MkdirTemp("", "imagebuild-")
	if err != nil {
		return Result{}, fmt.Errorf("build image: %w", err)
	}
	defer os.RemoveAll(tmp)

	var res Result
	var blobs []blob
	dirs := map[string]*node{}
	for i, l := range spec.Layers {
		b, diffID, err := stageLayer(tmp, i, l, dirs, spec.Gzip)
		if err != nil {
			return Result{}, fmt.Errorf("build image: layer %d: %w", i, err)
		}
		res.Layers = append(res.Layers, b.desc)
		res.DiffIDs = append(res.DiffIDs, diffID)
		blobs = append(blobs, b)
	}

	arch := spec.Arch
	if arch == "" {
		arch = runtime.GOARCH
	}
	platform := ocispec.Platform{Architecture: arch, OS: "linux"}
	diffIDs := res.DiffIDs
	if diffIDs == nil {
		diffIDs = []digest.Digest{}
	}
	cfg, err := jsonBlob(ocispec.MediaTypeImageConfig, ocispec.Image{
		Platform: platform,
		Config:   spec.Config.imageConfig(),
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: diffIDs},
	})
	if err != nil {
		return Result{}, err
	}
	res.Config = cfg.desc
	layers := res.Layers
	if layers == nil {
		layers = []ocispec.Descriptor{}
	}
	mf, err := jsonBlob(ocispec.MediaTypeImageManifest, ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    cfg.desc,
		Layers:    layers,
	})
	if err != nil {
		return Result{}, err
	}
	mf.desc.Platform = &platform
	res.Manifest = mf.desc
	blobs = append(blobs, cfg, mf)

	index, err := json.Marshal(ocispec.Index{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{mf.desc},
	})
	if err != nil {
		return Result{}, fmt.Errorf("build image: encode index: %w", err)
	}
	layout, err := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
	if err != nil {
		return Result{}, fmt.Errorf("build image: encode oci-layout: %w", err)
	}
	if err := writeArchive(w, layout, index, blobs); err != nil {
		return Result{}, fmt.Errorf("build image: %w", err)
	}
	return res, nil
}

// stageLayer writes layer i to a temporary file, hashing the uncompressed tar
// (the diff ID) and the stored blob (the digest) in one pass.
func stageLayer(dir string, i int, l Layer, dirs map[string]*node, gz bool) (blob, digest.Digest, error) {
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("layer-%d", i)))
	if err != nil {
		return blob{}, "", err
	}
	defer f.Close()
	blobHash, diffHash := sha256.New(), sha256.New()
	counter := &countWriter{}
	stored := io.MultiWriter(f, blobHash, counter)
	mediaType := ocispec.MediaTypeImageLayer
	var zw *gzip.Writer
	tarOut := io.MultiWriter(stored, diffHash)
	if gz {
		mediaType = ocispec.MediaTypeImageLayerGzip
		// No name and a zero ModTime in the gzip header keep it reproducible.
		zw = gzip.NewWriter(stored)
		tarOut = io.MultiWriter(zw, diffHash)
	}
	if err := writeLayer(tarOut, l, dirs); err != nil {
		return blob{}, "", err
	}
	if zw != nil {
		if err := zw.Close(); err != nil {
			return blob{}, "", fmt.Errorf("compress: %w", err)
		}
	}
	if err := f.Close(); err != nil {
		return blob{}, "", err
	}
	b := blob{
		desc: ocispec.Descriptor{
			MediaType: mediaType,
			Digest:    digest.NewDigest(digest.SHA256, blobHash),
			Size:      counter.n,
		},
		path: f.Name(),
	}
	return b, digest.NewDigest(digest.SHA256, diffHash), nil
}

type countWriter struct{ n int64 }

func (c *countWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return len(p), nil
}

func jsonBlob(mediaType string, v any) (blob, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return blob{}, fmt.Errorf("build image: encode %s: %w", mediaType, err)
	}
	return blob{
		desc: ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(data), Size: int64(len(data))},
		data: data,
	}, nil
}

// writeArchive writes the layout tar: oci-layout, index.json, then each
// distinct blob once, in digest order.
func writeArchive(w io.Writer, layout, index []byte, blobs []blob) error {
	sort.SliceStable(blobs, func(i, j int) bool { return blobs[i].desc.Digest < blobs[j].desc.Digest })
	tw := tar.NewWriter(w)
	hdr := func(name string, typ byte, size int64) error {
		mode := int64(0o644)
		if typ == tar.TypeDir {
			mode = 0o755
		}
		return tw.WriteHeader(&tar.Header{Typeflag: typ, Name: name, Size: size, Mode: mode, ModTime: Epoch, Format: tar.FormatPAX})
	}
	for _, f := range []struct {
		name string
		data []byte
	}{{ocispec.ImageLayoutFile, layout}, {ocispec.ImageIndexFile, index}} {
		if err := hdr(f.name, tar.TypeReg, int64(len(f.data))); err != nil {
			return err
		}
		if _, err := tw.Write(f.data); err != nil {
			return err
		}
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := hdr(d, tar.TypeDir, 0); err != nil {
			return err
		}
	}
	var last digest.Digest
	for _, b := range blobs {
		if b.desc.Digest == last {
			continue // two identical layers share one blob
		}
		last = b.desc.Digest
		if err := hdr("blobs/sha256/"+b.desc.Digest.Encoded(), tar.TypeReg, b.desc.Size); err != nil {
			return err
		}
		if err := copyBlob(tw, b); err != nil {
			return err
		}
	}
	return tw.Close()
}

func copyBlob(w io.Writer, b blob) error {
	if b.path == "" {
		_, err := w.Write(b.data)
		return err
	}
	f, err := os.Open(b.path)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(w, f)
	if err == nil && n != b.desc.Size {
		err = fmt.Errorf("staged blob %s: %d bytes, want %d", b.desc.Digest, n, b.desc.Size)
	}
	return err
}

package main

import (
	"archive/tar"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"runtime"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// probeImage is a one-layer OCI archive (as `ctr images import` reads) whose layer
// holds a file with random content, so its chain id is new to every snapshotter:
// finding that snapshot after an import proves the import unpacked into it.
type probeImage struct {
	archive []byte
	chainID digest.Digest // of the single layer: its diff id
}

func newProbeImage() (probeImage, error) {
	nonce := make([]byte, 16)
	if _, err := rand.Read(nonce); err != nil {
		return probeImage{}, err
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	body := []byte("tidepool doctor " + hex.EncodeToString(nonce) + "\n")
	if err := tw.WriteHeader(&tar.Header{Name: "tidepool-doctor", Mode: 0o644, Size: int64(len(body)), ModTime: time.Unix(0, 0), Typeflag: tar.TypeReg}); err != nil {
		return probeImage{}, err
	}
	tw.Write(body)
	if err := tw.Close(); err != nil {
		return probeImage{}, err
	}
	layerDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: digest.FromBytes(layer.Bytes()), Size: int64(layer.Len())}
	platform := ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH}
	config, err := json.Marshal(ocispec.Image{
		Platform: platform,
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{layerDesc.Digest}},
	})
	if err != nil {
		return probeImage{}, err
	}
	configDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(config), Size: int64(len(config))}
	manifest, err := json.Marshal(ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
		Config: configDesc, Layers: []ocispec.Descriptor{layerDesc},
	})
	if err != nil {
		return probeImage{}, err
	}
	manifestDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(manifest), Size: int64(len(manifest)), Platform: &platform}
	index, err := json.Marshal(ocispec.Index{
		Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{manifestDesc},
	})
	if err != nil {
		return probeImage{}, err
	}
	var out bytes.Buffer
	aw := tar.NewWriter(&out)
	add := func(name string, b []byte) error {
		if err := aw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: time.Unix(0, 0), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := aw.Write(b)
		return err
	}
	for _, f := range []struct {
		name string
		b    []byte
	}{
		{ocispec.ImageLayoutFile, []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
		{blobPath(layerDesc.Digest), layer.Bytes()},
		{blobPath(configDesc.Digest), config},
		{blobPath(manifestDesc.Digest), manifest},
	} {
		if err := add(f.name, f.b); err != nil {
			return probeImage{}, fmt.Errorf("probe image: %w", err)
		}
	}
	if err := aw.Close(); err != nil {
		return probeImage{}, err
	}
	return probeImage{archive: out.Bytes(), chainID: layerDesc.Digest}, nil
}

func blobPath(d digest.Digest) string { return "blobs/" + d.Algorithm().String() + "/" + d.Encoded() }

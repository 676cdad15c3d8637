package harness

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive"

	"github.com/tidepool-dev/tidepool/integration/imagebuild"
)

// BenchmarkCtrRunRm times `ctr run --rm busybox true` end to end (ctr start,
// container and snapshot creation, shim spawn, runc create/start, wait,
// teardown) against a baseline measured in the same iterations: `runc run` of
// a bundle holding the same busybox rootfs, which is the part no containerd
// path can avoid. x-vs-runc is the containerd path's cost as a multiple of it.
func BenchmarkCtrRunRm(b *testing.B) {
	c := StartContainerd(b, Options{LogLevel: "info"})
	img := imagebuild.BusyboxArchive(b)
	c.ImportImage(b, img.Path, imagebuild.BusyboxRef)
	bundle := runcBundle(b, c, img.Path)
	runc := mustTool(b, "runc")
	runcRoot := filepath.Join(c.RuncRoot, "bench") // the cleanup force-deletes what is left there

	var ctrTime, runcTime time.Duration
	i := 0
	for b.Loop() {
		i++
		start := time.Now()
		if _, err := c.Ctr("run", "--rm", "--fifo-dir", c.FIFODir, imagebuild.BusyboxRef, fmt.Sprintf("bench-%d", i), "true"); err != nil {
			b.Fatal(err)
		}
		ctrTime += time.Since(start)

		start = time.Now()
		// Without -d, runc run waits for the process and deletes the container.
		cmd := exec.Command(runc, "--root", runcRoot, "run", "--bundle", bundle, fmt.Sprintf("baseline-%d", i))
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("runc run: %v: %s", err, out)
		}
		runcTime += time.Since(start)
	}
	b.ReportMetric(float64(ctrTime.Milliseconds())/float64(i), "ctr-ms/op")
	b.ReportMetric(float64(runcTime.Milliseconds())/float64(i), "runc-ms/op")
	b.ReportMetric(float64(ctrTime)/float64(runcTime), "x-vs-runc")
}

// runcBundle makes an OCI bundle running /bin/true in the busybox image's
// rootfs, with its cgroup under the instance's namespace (so the cleanup
// covers it).
func runcBundle(b *testing.B, c *Containerd, imageArchive string) string {
	b.Helper()
	bundle := filepath.Join(c.Dir, "bench-bundle")
	rootfs := filepath.Join(bundle, "rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		b.Fatal(err)
	}
	layer, err := firstLayer(imageArchive)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := archive.Apply(context.Background(), rootfs, bytes.NewReader(layer)); err != nil {
		b.Fatalf("unpack rootfs: %v", err)
	}
	runc := mustTool(b, "runc")
	if out, err := exec.Command(runc, "spec", "--bundle", bundle).CombinedOutput(); err != nil {
		b.Fatalf("runc spec: %v: %s", err, out)
	}
	path := filepath.Join(bundle, "config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(data, &spec); err != nil {
		b.Fatal(err)
	}
	process := spec["process"].(map[string]any)
	process["terminal"] = false
	process["args"] = []string{"true"}
	spec["linux"].(map[string]any)["cgroupsPath"] = "/" + c.Namespace + "/baseline"
	if data, err = json.Marshal(spec); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		b.Fatal(err)
	}
	return bundle
}

// firstLayer returns the first layer blob of an OCI layout archive.
func firstLayer(imageArchive string) ([]byte, error) {
	f, err := os.Open(imageArchive)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	blobs := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			return nil, err
		}
		blobs[hdr.Name] = data
	}
	var index, manifest struct {
		Manifests []struct{ Digest string } `json:"manifests"`
		Layers    []struct{ Digest string } `json:"layers"`
	}
	if err := json.Unmarshal(blobs["index.json"], &index); err != nil || len(index.Manifests) == 0 {
		return nil, fmt.Errorf("index.json: %v", err)
	}
	blob := func(d string) []byte { return blobs["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")] }
	if err := json.Unmarshal(blob(index.Manifests[0].Digest), &manifest); err != nil || len(manifest.Layers) == 0 {
		return nil, fmt.Errorf("manifest: %v", err)
	}
	return blob(manifest.Layers[0].Digest), nil
}

package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/shim"
)

// TestCRIPodWithFork is the Kubernetes path without a kubelet: a CRI client runs a
// pod with RuntimeHandler "tidepool" and the pod annotation dev.tidepool.fork, and the
// app container sees baked dependencies and the fork at its workdir. The handler is
// configured as contrib/containerd/cri-runtime.toml says, its shim options arriving as
// CRI's ConfigBody.
func TestCRIPodWithFork(t *testing.T) {
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{Prepare: func(s *stack.Stack, o *harness.Options) {
		o.CRI = true
		o.Runtimes = map[string]harness.Runtime{
			"tidepool": {
				Type:                 shim.RuntimeName,
				Snapshotter:          "tidepool",
				PodAnnotations:       []string{"dev.tidepool.*"},
				ContainerAnnotations: []string{"dev.tidepool.*"},
				Options: map[string]any{
					"api_address": s.APIAddress,
					"runtimes":    map[string]any{"runc": map[string]any{"kind": "runc", "root": filepath.Join(s.Dir, "runc")}},
				},
			},
		}
	}})
	s.C.ImportImageInNamespace(t, harness.CRINamespace, node.Path, imagebuild.NodeRef, "tidepool")
	pods := "/" + s.C.Namespace + "-pods"
	if err := s.C.TrackCgroup(pods); err != nil {
		t.Fatal(err)
	}
	root := s.Ingest(t, writeTree(t, appSource))

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rt, _, err := s.C.CRI(ctx)
	if err != nil {
		t.Fatal(err)
	}
	podCfg := &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "agent", Namespace: "default", Uid: s.C.Namespace},
		Annotations: map[string]string{
			binding.AnnotationFork:    root,
			binding.AnnotationWorkdir: "/app",
		},
		LogDirectory: t.TempDir(),
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent: pods,
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE},
			},
		},
	}
	pod, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: podCfg, RuntimeHandler: "tidepool"})
	if err != nil {
		t.Fatalf("RunPodSandbox: %v", err)
	}
	defer func() {
		rt.StopPodSandbox(context.Background(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod.PodSandboxId})
		rt.RemovePodSandbox(context.Background(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: pod.PodSandboxId})
	}()
	ctrCfg := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "app"},
		Image:    &runtimeapi.ImageSpec{Image: imagebuild.NodeRef},
		Command:  []string{"sh", "-c", "node /app/src/main.js && echo from-pod > /app/pod.txt"},
		LogPath:  "app.log",
	}
	created, err := rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: pod.PodSandboxId, Config: ctrCfg, SandboxConfig: podCfg})
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: created.ContainerId}); err != nil {
		t.Fatalf("StartContainer: %v", err)
	}
	var st *runtimeapi.ContainerStatusResponse
	for {
		st, err = rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: created.ContainerId})
		if err != nil {
			t.Fatal(err)
		}
		if st.Status.State == runtimeapi.ContainerState_CONTAINER_EXITED {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	logs := criLogs(t, filepath.Join(podCfg.LogDirectory, "app.log"))
	if st.Status.ExitCode != 0 || logs != "hello Tidepool\n" {
		t.Fatalf("app container exited %d, logs %q", st.Status.ExitCode, logs)
	}
	if _, err := rt.RemoveContainer(ctx, &runtimeapi.RemoveContainerRequest{ContainerId: created.ContainerId}); err != nil {
		t.Fatal(err)
	}
	// The app container's writes under the workdir become its fork's next root.
	f := s.WaitFork(t, "for the app container", func(f forks.Fork) bool {
		return f.Base.String() == root && f.Root.String() != root
	})
	if d := s.MustTidepool(t, "diff", root, f.ID); d != "A pod.txt\n" {
		t.Fatalf("fork changes %q", d)
	}
}

func criLogs(t testing.TB, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		// CRI log lines: timestamp stream tag message.
		if parts := strings.SplitN(line, " ", 4); len(parts) == 4 {
			out.WriteString(parts[3] + "\n")
		}
	}
	return out.String()
}

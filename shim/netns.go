package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// netnsFile is where the shim keeps a network namespace it created for a container.
const netnsFile = "tidepool-netns"

// ensureNetns gives a container the new network namespace its spec asks for, for
// runtimes that join network namespaces but do not create them (gVisor's runsc
// expects the caller, normally CNI, to have made one). runc would create it itself;
// this makes the same spec behave the same under both. The namespace is bind-mounted
// in the bundle and removed by releaseNetns.
func ensureNetns(bundle string) error {
	path := filepath.Join(bundle, oci.ConfigFilename)
	spec, err := oci.ReadSpec(path)
	if err != nil {
		return fmt.Errorf("read bundle spec: %w", err)
	}
	if spec.Linux == nil {
		return nil
	}
	idx := -1
	for i, ns := range spec.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace {
			idx = i
		}
	}
	if idx < 0 || spec.Linux.Namespaces[idx].Path != "" {
		return nil // the host's network, or a namespace someone made already
	}
	target := filepath.Join(bundle, netnsFile)
	if err := newNetns(target); err != nil {
		return fmt.Errorf("create network namespace: %w", err)
	}
	spec.Linux.Namespaces[idx].Path = target
	if err := writeSpec(path, spec); err != nil {
		releaseNetns(bundle)
		return err
	}
	return nil
}

// newNetns creates a network namespace and bind-mounts it at target. The unshare
// happens on a locked thread that is thrown away afterwards, so no goroutine ever
// runs in the new namespace.
func newNetns(target string) error {
	f, err := os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return err
	}
	f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(self, target, "", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind mount: %w", err)
			return
		}
		errc <- nil
	}()
	if err := <-errc; err != nil {
		os.Remove(target)
		return err
	}
	return nil
}

// releaseNetns removes a namespace ensureNetns made; absent is fine.
func releaseNetns(bundle string) {
	target := filepath.Join(bundle, netnsFile)
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return
	}
	os.Remove(target)
}

func writeSpec(path string, spec *specs.Spec) error {
	b, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("write bundle spec: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write bundle spec: %w", err)
	}
	return nil
}

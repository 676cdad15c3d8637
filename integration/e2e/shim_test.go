package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/shim"
)

// shimConfig writes a shim config naming the stack's API socket (plus extra TOML) and
// returns the ctr flags that select the tidepool runtime with it, as
// `nerdctl run --runtime io.containerd.tidepool.v1` would on a host whose
// /etc/tidepool/shim.toml says the same.
func shimFlags(t testing.TB, s *stack.Stack, extra string) []string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "shim.toml")
	body := fmt.Sprintf("api_address = %q\n%s", s.APIAddress, extra)
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return []string{"--runtime", shim.RuntimeName, "--runtime-config-path", p, "--snapshotter", "tidepool"}
}

func annotations(kv ...string) []string {
	var out []string
	for _, a := range kv {
		out = append(out, "--annotation", a)
	}
	return out
}

func TestShimForkFromAnnotations(t *testing.T) {
	node := imagebuild.NodeArchive(t)
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, node.Path, imagebuild.NodeRef, "tidepool")
	root := s.Ingest(t, writeTree(t, appSource))

	flags := append(shimFlags(t, s, ""), annotations(
		binding.AnnotationFork+"="+root, binding.AnnotationWorkdir+"=/app")...)
	flags = append(flags, "--user", "1000:1000")
	script := "node /app/src/main.js && stat -c '%u:%g' /app/src/main.js && echo new > /app/new.txt && rm /app/src/old.js"
	out := runRm(t, s, "ann1", flags, imagebuild.NodeRef, "sh", "-c", script)
	// Without dev.tidepool.owner the fork belongs to the process user.
	if out != "hello Tidepool\n1000:1000\n" {
		t.Fatalf("container printed %q", out)
	}
	f := forkOfContainer(t, s, "ann1", root)
	if d := s.MustTidepool(t, "diff", root, f.ID); d != "A new.txt\nD src/old.js\n" {
		t.Fatalf("fork changes %q", d)
	}
	s.C.LeakCheck(t)
}

// TestShimRunsc: dev.tidepool.runtime=runsc runs the workload under gVisor (Debian's
// runsc as the OCI binary of the in-process runc route). The kernel the workload sees
// is gVisor's Sentry, not the host's.
func TestShimRunsc(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	host, err := os.ReadFile("/proc/version")
	if err != nil {
		t.Fatal(err)
	}
	// Debian's runsc cannot start sandbox networking on this kernel (see
	// contrib/runsc/runsc-nonet), so the route uses the wrapper shipped for that.
	repo, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	route := fmt.Sprintf("[runtimes.runsc]\nkind = \"runc\"\nbinary_name = %q\ncreate_netns = true\n", filepath.Join(repo, "contrib/runsc/runsc-nonet"))
	flags := append(shimFlags(t, s, route), annotations(shim.AnnotationRuntime+"=runsc")...)
	out := runRm(t, s, "gvisor", flags, imagebuild.BusyboxRef, "sh", "-c", "cat /proc/version; dmesg | head -1")
	if strings.Contains(out, strings.TrimSpace(string(host))) || !strings.Contains(strings.ToLower(out), "gvisor") {
		t.Fatalf("not gVisor: the container saw\n%s\nthe host has\n%s", out, host)
	}
	t.Logf("under runsc: %s", out)
	s.C.LeakCheck(t)
}

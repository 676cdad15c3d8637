package install

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/hostcheck"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/shim"
)

type report struct {
	OK     bool              `json:"ok"`
	Checks []hostcheck.Check `json:"checks"`
}

// doctor runs `tidepool doctor --json` and returns its report and exit status.
func doctor(t *testing.T, bin string, args ...string) (report, int) {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "tidepool"), append(args, "doctor", "--json")...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("tidepool doctor: %v: %s", err, stderr.String())
	}
	var rep report
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("tidepool doctor --json: %v\n%s\n%s", err, out, stderr.String())
	}
	for _, c := range rep.Checks {
		t.Logf("%-8s %-40s %s %s", c.Status, c.Name, c.Detail, c.Fix)
	}
	if stderr.Len() > 0 {
		t.Logf("doctor's stderr: %s", stderr.String())
	}
	return rep, code
}

func find(t *testing.T, rep report, name string) hostcheck.Check {
	t.Helper()
	for _, c := range rep.Checks {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("doctor has no check %q", name)
	return hostcheck.Check{}
}

// TestDoctor: against a full stack (containerd with the proxy plugin, the transfer
// unpack entry and the CRI handler, tidepoold running) every check is what this
// machine has: all required ones ok, exit 0, the optional routes present exactly
// when their binaries are on containerd's PATH; the probe image is gone afterwards.
func TestDoctor(t *testing.T) {
	s := stack.Start(t, stack.Options{Prepare: func(s *stack.Stack, o *harness.Options) {
		o.CRI = true
		o.Runtimes = map[string]harness.Runtime{"tidepool": {
			Type: shim.RuntimeName, Snapshotter: "tidepool",
			PodAnnotations: []string{"dev.tidepool.*"}, ContainerAnnotations: []string{"dev.tidepool.*"},
		}}
	}})
	rep, code := doctor(t, s.Bin, "--root", s.Root, "--containerd-address", s.C.Address)
	if code != 0 || !rep.OK {
		t.Errorf("doctor exit %d, ok %v; want 0, true", code, rep.OK)
	}
	for _, c := range rep.Checks {
		if c.Required && !c.OK() {
			t.Errorf("required check %q: %s (%s)", c.Name, c.Status, c.Detail)
		}
	}
	for _, name := range []string{"overlayfs data-only lowers + metacopy", "erofs file-backed mounts", "fuse passthrough",
		"trusted.* xattrs on the root", "cgroup freezer", "containerd proxy plugin tidepool", "containerd transfer unpack for tidepool",
		"containerd runtime " + shim.RuntimeName, "CRI runtime handler tidepool", "tidepoold", "pools", "route runc"} {
		if c := find(t, rep, name); !c.OK() {
			t.Errorf("%s: %s (%s), want ok on this machine", name, c.Status, c.Detail)
		}
	}
	// Optional routes: ok exactly when the binary is on containerd's PATH.
	for route, bin := range map[string]string{"route runsc": "runsc", "route kata-fc": "containerd-shim-kata-v2"} {
		_, err := exec.LookPath(bin)
		_, inDeps := testenv.Tool(bin)
		present := err == nil || inDeps == nil
		if c := find(t, rep, route); c.OK() != present || c.Required {
			t.Errorf("%s: %s (required %v), want ok=%v and optional", route, c.Status, c.Required, present)
		}
	}
	if c := find(t, rep, "containerd"); !strings.Contains(c.Detail, "2.4.2") {
		t.Errorf("containerd version: %q", c.Detail)
	}
	// The transfer probe cleaned up after itself.
	if ns, _ := s.C.Ctr("namespaces", "ls", "-q"); strings.Contains(ns, "tidepool-doctor") {
		var what []string
		for _, args := range [][]string{{"leases", "ls"}, {"images", "ls", "-q"}, {"content", "ls", "-q"}, {"snapshots", "--snapshotter", "tidepool", "ls"}} {
			out, err := s.C.CtrContext(context.Background(), "tidepool-doctor", args...)
			what = append(what, fmt.Sprintf("%v: %q %v", args, out, err))
		}
		t.Errorf("doctor left its namespace: %q\n%s\ntidepoold:\n%s", ns, strings.Join(what, "\n"), s.Daemon.LogTail(15))
	}
	// One line per check in the plain output as well.
	out, err := exec.Command(filepath.Join(s.Bin, "tidepool"), "--root", s.Root, "doctor", "--containerd-address", s.C.Address).Output()
	if err != nil {
		t.Fatalf("doctor (text): %v", err)
	}
	if lines := strings.Split(strings.TrimSpace(string(out)), "\n"); len(lines) != len(rep.Checks) {
		t.Errorf("text output has %d lines for %d checks:\n%s", len(lines), len(rep.Checks), out)
	}
}

// TestDoctorWithoutProxyPlugin: a containerd whose config lacks the tidepool proxy
// plugin (and no tidepoold) is reported missing, with the fix, and doctor exits 1.
func TestDoctorWithoutProxyPlugin(t *testing.T) {
	bin := stack.Binaries(t)
	c := harness.StartContainerd(t, harness.Options{})
	root := t.TempDir()
	rep, code := doctor(t, bin, "--root", root, "--containerd-address", c.Address)
	if code != 1 || rep.OK {
		t.Errorf("doctor exit %d, ok %v; want 1, false", code, rep.OK)
	}
	p := find(t, rep, "containerd proxy plugin tidepool")
	if p.Status != hostcheck.Missing || !p.Required || !strings.Contains(p.Fix, "tidepool install") {
		t.Errorf("proxy plugin check: %+v, want required, missing, fix naming tidepool install", p)
	}
	if u := find(t, rep, "containerd transfer unpack for tidepool"); u.Status != hostcheck.Missing {
		t.Errorf("unpack check: %+v, want missing", u)
	}
	if d := find(t, rep, "tidepoold"); d.Status != hostcheck.Missing || d.Fix == "" {
		t.Errorf("tidepoold check: %+v, want missing with a fix", d)
	}
	// containerd itself is fine, and so is the host.
	for _, name := range []string{"containerd", "overlayfs", "fuse", "cgroups"} {
		if c := find(t, rep, name); !c.OK() {
			t.Errorf("%s: %+v, want ok", name, c)
		}
	}
}

// TestDoctorWithoutUnpackEntry: a containerd that loads the tidepool proxy plugin (a
// live tidepoold behind it) but whose transfer service has no unpack entry for it (so
// `ctr images pull --snapshotter tidepool` cannot unpack there): the doctor's import
// probe reports it missing, with the fix, exit 1, and leaves nothing behind.
func TestDoctorWithoutUnpackEntry(t *testing.T) {
	s := stack.Start(t, stack.Options{})
	c := harness.StartContainerd(t, harness.Options{ProxyPlugins: map[string]harness.ProxyPlugin{
		"tidepool": {Type: "snapshot", Address: s.SnapAddress, Exports: map[string]string{"root": s.Root}, Capabilities: []string{"rebase"}},
	}})
	rep, code := doctor(t, s.Bin, "--root", s.Root, "--containerd-address", c.Address)
	if code != 1 || rep.OK {
		t.Errorf("doctor exit %d, ok %v; want 1, false", code, rep.OK)
	}
	if p := find(t, rep, "containerd proxy plugin tidepool"); !p.OK() {
		t.Errorf("proxy plugin: %+v, want ok", p)
	}
	u := find(t, rep, "containerd transfer unpack for tidepool")
	if u.Status != hostcheck.Missing || !strings.Contains(u.Detail, "no unpack entry for tidepool") || !strings.Contains(u.Fix, "unpack_config") {
		t.Errorf("unpack check: %+v, want missing, naming the missing unpack entry, fix naming unpack_config", u)
	}
	if ns, _ := c.Ctr("namespaces", "ls", "-q"); strings.Contains(ns, "tidepool-doctor") {
		t.Errorf("doctor left its namespace: %q", ns)
	}
}

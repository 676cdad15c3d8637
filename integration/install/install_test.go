package install

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/integration/testenv"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/shim"
)

// tree maps every path under dir to its type, mode and content (or link target).
func tree(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			l, _ := os.Readlink(p)
			out[rel] = "link " + l
		case d.IsDir():
			out[rel] = fmt.Sprintf("dir %v", info.Mode())
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[rel] = fmt.Sprintf("file %v %x", info.Mode(), sha256.Sum256(b))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffTrees(a, b map[string]string) []string {
	var d []string
	for k, v := range a {
		if b[k] != v {
			d = append(d, fmt.Sprintf("%s: %q -> %q", k, v, b[k]))
		}
	}
	for k, v := range b {
		if _, ok := a[k]; !ok {
			d = append(d, fmt.Sprintf("%s: added %q", k, v))
		}
	}
	return d
}

func tidepool(t *testing.T, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "tidepool"), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tidepool %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.String())
	}
	return string(out)
}

// rebase copies a file installed under host root T into R, with the host paths it
// names moved under R, so that a private containerd and tidepoold can run from what
// install wrote without touching this machine's /etc, /run or /var/lib.
func rebase(t *testing.T, T, R, hostPath string, extra ...string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(T, hostPath))
	if err != nil {
		t.Fatal(err)
	}
	r := strings.NewReplacer(append([]string{
		"'/etc/containerd/conf.d", "'" + R + "/etc/containerd/conf.d",
		"'/run/tidepool", "'" + R + "/run/tidepool",
		"'/var/lib/tidepool", "'" + R + "/var/lib/tidepool",
	}, extra...)...)
	dst := filepath.Join(R, hostPath)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, []byte(r.Replace(string(b))), 0o644); err != nil {
		t.Fatal(err)
	}
	return dst
}

// operatorConfig is T's containerd config as the harness can run it: the keys that
// place containerd on this machine (root, state, sockets, the opt dir, CNI, NRI, the
// shim socket dir, its log level, disabled plugins) stay the harness's, everything
// else, imports included (rebased under R), is the operator's file as installed.
func operatorConfig(t *testing.T, T, R string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(T, "etc/containerd/config.toml"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := toml.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"root", "state", "temp", "disabled_plugins", "required_plugins", "debug", "grpc", "ttrpc", "metrics", "oom_score"} {
		delete(cfg, k)
	}
	if plugins, ok := cfg["plugins"].(map[string]any); ok {
		for _, k := range []string{"io.containerd.server.v1.grpc", "io.containerd.server.v1.ttrpc", "io.containerd.server.v1.grpc-tcp",
			"io.containerd.server.v1.debug", "io.containerd.server.v1.metrics", "io.containerd.internal.v1.opt",
			"io.containerd.shim.v1.manager", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images",
			"io.containerd.grpc.v1.cri", "io.containerd.nri.v1.nri"} {
			delete(plugins, k)
		}
	}
	var imports []string
	for _, imp := range cfg["imports"].([]any) {
		imports = append(imports, R+imp.(string))
	}
	cfg["imports"] = imports
	out, err := toml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// TestInstallOnHostRoot is the acceptance test of `tidepool install --host-root`: on a
// tree holding a stock containerd config (`containerd config default`), install
// writes the binaries, tidepoold's config and unit and a containerd drop-in; a
// containerd started from that config (its host paths moved into a private dir) and
// a tidepoold started from the unit's command line run a container on a fork through
// the shim with annotations; a second install changes nothing; uninstall leaves the
// tree byte-identical to before.
func TestInstallOnHostRoot(t *testing.T) {
	testenv.RequireRoot(t)
	bin := stack.Binaries(t)
	containerd, err := testenv.Tool("containerd")
	if err != nil {
		t.Skip(err)
	}
	T := t.TempDir()
	stock, err := exec.Command(containerd, "config", "default").Output()
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(T, "etc/containerd"), 0o755)
	os.MkdirAll(filepath.Join(T, "usr/local/bin"), 0o755)
	os.WriteFile(filepath.Join(T, "etc/containerd/config.toml"), stock, 0o644)
	before := tree(t, T)

	dry := tidepool(t, bin, "install", "--host-root", T, "--from", bin, "--dry-run")
	if d := diffTrees(before, tree(t, T)); len(d) > 0 || !strings.Contains(dry, "create") {
		t.Fatalf("dry run changed %v or printed no plan:\n%s", d, dry)
	}
	out := tidepool(t, bin, "install", "--host-root", T, "--from", bin)
	t.Logf("install:\n%s", out)
	for _, p := range []string{"usr/local/bin/tidepoold", "usr/local/bin/containerd-shim-tidepool-v1", "etc/tidepool/tidepoold.toml",
		"etc/systemd/system/tidepoold.service", "etc/systemd/system/multi-user.target.wants/tidepoold.service", "etc/containerd/conf.d/tidepool.toml"} {
		if _, err := os.Lstat(filepath.Join(T, p)); err != nil {
			t.Errorf("install did not write %s: %v", p, err)
		}
	}
	// The stock config imports /etc/containerd/conf.d/*.toml already: untouched.
	if b, _ := os.ReadFile(filepath.Join(T, "etc/containerd/config.toml")); !bytes.Equal(b, stock) {
		t.Error("install edited a config whose imports already cover the drop-in")
	}
	if !strings.Contains(out, "systemctl restart containerd") {
		t.Errorf("install did not print the restart command:\n%s", out)
	}
	installed := tree(t, T)
	again := tidepool(t, bin, "install", "--host-root", T, "--from", bin)
	if d := diffTrees(installed, tree(t, T)); len(d) > 0 || !strings.Contains(again, "nothing to change") {
		t.Fatalf("second install changed %v:\n%s", d, again)
	}

	runFromInstalled(t, T, bin)

	if d := diffTrees(installed, tree(t, T)); len(d) > 0 {
		t.Fatalf("running the stack changed the installed tree: %v", d)
	}
	un := tidepool(t, bin, "uninstall", "--host-root", T)
	t.Logf("uninstall:\n%s", un)
	if d := diffTrees(before, tree(t, T)); len(d) > 0 {
		t.Fatalf("after uninstall the tree differs from before install: %v", d)
	}
	if un2 := tidepool(t, bin, "uninstall", "--host-root", T); !strings.Contains(un2, "nothing to remove") {
		t.Errorf("second uninstall: %s", un2)
	}
}

// runFromInstalled starts containerd and tidepoold from what install wrote under T
// and runs a container on a fork through the shim.
func runFromInstalled(t *testing.T, T, bin string) {
	R, err := os.MkdirTemp("/tmp", "tpi-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if left, _ := harness.MountsUnder(R); len(left) > 0 {
			t.Errorf("mounts left under %s: %v", R, left)
			for i := len(left) - 1; i >= 0; i-- {
				exec.Command("umount", "-l", left[i]).Run()
			}
		}
		os.RemoveAll(R)
	})
	// tidepoold is stopped after containerd (cleanups run last-registered first).
	var daemon *harness.Daemon
	t.Cleanup(func() {
		if daemon != nil {
			if t.Failed() {
				t.Logf("tidepoold:\n%s", daemon.LogTail(60))
			}
			daemon.Stop()
			daemon.Close()
		}
	})
	rebase(t, T, R, "etc/containerd/conf.d/tidepool.toml")
	c := harness.StartContainerd(t, harness.Options{
		ExtraTOML: operatorConfig(t, T, R),
		// The shim and tidepoold come from T's /usr/local/bin.
		Env: []string{"PATH=" + filepath.Join(T, "usr/local/bin") + ":" + testenv.SearchPath()},
	})
	// tidepoold from the unit's ExecStart, its paths moved under R.
	unit, err := os.ReadFile(filepath.Join(T, "etc/systemd/system/tidepoold.service"))
	if err != nil {
		t.Fatal(err)
	}
	var argv []string
	for _, l := range strings.Split(string(unit), "\n") {
		if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
			argv = strings.Fields(v)
		}
	}
	if len(argv) < 3 || argv[0] != "/usr/local/bin/tidepoold" || argv[1] != "--config" {
		t.Fatalf("unit's ExecStart %q", argv)
	}
	cfg := rebase(t, T, R, argv[2][1:], "'/run/containerd/containerd.sock'", "'"+c.Address+"'", "'127.0.0.1:9840'", "''")
	argv[0], argv[2] = filepath.Join(T, argv[0]), cfg
	api := filepath.Join(R, "run/tidepool/api.sock")
	daemon = harness.NewDaemon(harness.DaemonSpec{
		Name: "tidepoold", Path: argv[0], Args: argv[1:],
		Env:     append(os.Environ(), "PATH="+testenv.SearchPath()),
		LogPath: filepath.Join(R, "tidepoold.log"),
		Notify:  true, // the unit is Type=notify
		Ready: func(ctx context.Context) error {
			cl, err := localapi.Dial(ctx, api, time.Second)
			if err != nil {
				return err
			}
			return cl.Close()
		},
	})
	if err := daemon.Start(context.Background()); err != nil {
		t.Fatalf("tidepoold from the unit: %v\n%s", err, daemon.LogTail(30))
	}
	root := filepath.Join(R, "var/lib/tidepool")
	// Import unpacks into tidepool only if the drop-in's unpack entry is in force.
	c.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "hello.txt"), []byte("from the fork\n"), 0o644)
	tp := func(args ...string) string {
		return strings.TrimSpace(tidepool(t, filepath.Join(T, "usr/local/bin"), append([]string{"--root", root}, args...)...))
	}
	lines := strings.Split(tp("ingest", src), "\n")
	base := lines[len(lines)-1]
	fork := tp("fork", base)
	shimCfg := filepath.Join(R, "shim.toml")
	os.WriteFile(shimCfg, []byte(fmt.Sprintf("api_address = %q\n", api)), 0o644)
	got, err := c.Ctr("run", "--rm", "--fifo-dir", c.FIFODir, "--runtime", shim.RuntimeName, "--runtime-config-path", shimCfg,
		"--snapshotter", "tidepool", "--annotation", binding.AnnotationFork+"="+fork, "--annotation", binding.AnnotationWorkdir+"=/src",
		imagebuild.BusyboxRef, "installed", "sh", "-c", "cat /src/hello.txt && echo added > /src/new.txt")
	if err != nil {
		t.Fatalf("%v\ntidepoold:\n%s", err, daemon.LogTail(30))
	}
	if got != "from the fork\n" {
		t.Fatalf("container printed %q", got)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		d := tp("diff", base, fork)
		if d == "A new.txt" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fork %s diff %q, want A new.txt", fork, d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// And the doctor agrees this containerd is set up.
	rep, code := doctor(t, filepath.Join(T, "usr/local/bin"), "--root", root, "--containerd-address", c.Address)
	for _, name := range []string{"containerd proxy plugin tidepool", "containerd transfer unpack for tidepool", "containerd runtime " + shim.RuntimeName, "tidepoold"} {
		if ch := find(t, rep, name); !ch.OK() {
			t.Errorf("doctor on the installed config: %s: %s (%s)", name, ch.Status, ch.Detail)
		}
	}
	if code != 0 {
		t.Errorf("doctor exit %d on the installed config", code)
	}
	c.LeakCheck(t)
}

// TestInstallEditsImportsAndRestores: a containerd config without an imports line gets
// exactly one line added (the operator's lines untouched), a file install replaces is
// put back by uninstall, and the tree ends byte-identical.
func TestInstallEditsImportsAndRestores(t *testing.T) {
	testenv.RequireRoot(t)
	bin := stack.Binaries(t)
	T := t.TempDir()
	operator := "version = 3\n# the operator's own comment\nroot = '/data/containerd'\n\n[plugins.'io.containerd.gc.v1.scheduler']\n  deletion_threshold = 0\n"
	os.MkdirAll(filepath.Join(T, "etc/containerd"), 0o755)
	os.WriteFile(filepath.Join(T, "etc/containerd/config.toml"), []byte(operator), 0o640)
	os.MkdirAll(filepath.Join(T, "usr/local/bin"), 0o755)
	os.WriteFile(filepath.Join(T, "usr/local/bin/tidepool"), []byte("#!/bin/sh\necho an older tidepool\n"), 0o755)
	before := tree(t, T)

	out := tidepool(t, bin, "install", "--host-root", T, "--from", bin)
	got, _ := os.ReadFile(filepath.Join(T, "etc/containerd/config.toml"))
	want := strings.Replace(operator, "version = 3\n", "version = 3\nimports = ['/etc/containerd/conf.d/tidepool.toml']\n", 1)
	if string(got) != want {
		t.Fatalf("config after install:\n%s\nwant:\n%s\ninstall said:\n%s", got, want, out)
	}
	if st, _ := os.Stat(filepath.Join(T, "etc/containerd/config.toml")); st.Mode().Perm() != 0o640 {
		t.Errorf("config mode %v, want the operator's 0640", st.Mode().Perm())
	}
	drop, _ := os.ReadFile(filepath.Join(T, "etc/containerd/conf.d/tidepool.toml"))
	if !strings.Contains(string(drop), "version = 3\n") {
		t.Errorf("drop-in does not follow the main config's version 3:\n%s", drop)
	}
	installed := tree(t, T)
	if again := tidepool(t, bin, "install", "--host-root", T, "--from", bin); !strings.Contains(again, "nothing to change") {
		t.Errorf("second install: %s", again)
	}
	if d := diffTrees(installed, tree(t, T)); len(d) > 0 {
		t.Fatalf("second install changed %v", d)
	}
	if dry := tidepool(t, bin, "uninstall", "--host-root", T, "--dry-run"); !strings.Contains(dry, "restore  /usr/local/bin/tidepool") {
		t.Errorf("uninstall --dry-run does not plan to restore the replaced binary:\n%s", dry)
	}
	if d := diffTrees(installed, tree(t, T)); len(d) > 0 {
		t.Fatalf("uninstall --dry-run changed %v", d)
	}
	tidepool(t, bin, "uninstall", "--host-root", T)
	if d := diffTrees(before, tree(t, T)); len(d) > 0 {
		t.Fatalf("after uninstall the tree differs from before install: %v", d)
	}
}

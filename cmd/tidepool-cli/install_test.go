package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pelletier/go-toml/v2"
)

func TestAddImport(t *testing.T) {
	const dropin = "/etc/containerd/conf.d/tidepool.toml"
	for _, tc := range []struct{ name, in, want string }{
		{"no imports", "version = 3\nroot = '/var/lib/containerd'\n\n[plugins]\n", "version = 3\nimports = ['" + dropin + "']\nroot = '/var/lib/containerd'\n\n[plugins]\n"},
		{"no version", "root = '/x'\n", "imports = ['" + dropin + "']\nroot = '/x'\n"},
		{"empty list", "version = 3\nimports = []\n", "version = 3\nimports = ['" + dropin + "']\n"},
		{"one entry and a comment", "version = 2\nimports = [\"/etc/other.toml\"] # mine\n[x]\nimports = 1\n",
			"version = 2\nimports = [\"/etc/other.toml\", '" + dropin + "'] # mine\n[x]\nimports = 1\n"},
		{"trailing comma", "imports = ['/a.toml',]\n", "imports = ['/a.toml', '" + dropin + "']\n"},
		{"imports only in a table", "version = 3\n[plugins.x]\n  imports = ['/y']\n", "version = 3\nimports = ['" + dropin + "']\n[plugins.x]\n  imports = ['/y']\n"},
		{"no final newline", "version = 3", "version = 3\nimports = ['" + dropin + "']\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, edit, err := addImport([]byte(tc.in), dropin)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("addImport:\n%s\nwant:\n%s", got, tc.want)
			}
			mc, err := parseMainConfig(got)
			if err != nil {
				t.Fatalf("result does not parse: %v\n%s", err, got)
			}
			if !importsDropIn(mc.Imports, "/etc/containerd/config.toml", dropin) {
				t.Fatalf("result's imports %v miss the drop-in", mc.Imports)
			}
			back, ok := removeImport(got, edit)
			want := tc.in
			if !strings.HasSuffix(want, "\n") {
				want += "\n" // the one byte addImport had to add before its line
			}
			if !ok || string(back) != want {
				t.Fatalf("removeImport gave %q (%v), want %q", back, ok, want)
			}
		})
	}
	if _, _, err := addImport([]byte("imports = [\n  '/a.toml',\n]\n"), dropin); err == nil || !strings.Contains(err.Error(), "by hand") {
		t.Fatalf("multi-line imports: %v, want an error saying to edit by hand", err)
	}
}

func TestImportsDropIn(t *testing.T) {
	const cfg, dropin = "/etc/containerd/config.toml", "/etc/containerd/conf.d/tidepool.toml"
	for imports, want := range map[string]bool{
		"/etc/containerd/conf.d/*.toml": true, "conf.d/*.toml": true, dropin: true,
		"/etc/containerd/conf.d/*.conf": false, "/etc/other/*.toml": false,
	} {
		if got := importsDropIn([]string{imports}, cfg, dropin); got != want {
			t.Errorf("imports %q: %v, want %v", imports, got, want)
		}
	}
}

// The unit install writes is contrib's, and the drop-in is valid TOML naming what
// contrib's snippets name.
func TestInstallFilesMatchContrib(t *testing.T) {
	unit, err := os.ReadFile("../../contrib/systemd/tidepoold.service")
	if err != nil {
		t.Fatal(err)
	}
	if string(unit) != tidepooldUnit {
		t.Error("tidepooldUnit differs from contrib/systemd/tidepoold.service: keep them equal")
	}
	var cfg map[string]any
	if err := toml.Unmarshal([]byte(dropIn(3, "linux/amd64")), &cfg); err != nil {
		t.Fatalf("drop-in: %v", err)
	}
	proxy := cfg["proxy_plugins"].(map[string]any)["tidepool"].(map[string]any)
	if proxy["address"] != defaultSnapAddress || proxy["type"] != "snapshot" {
		t.Errorf("proxy plugin: %v", proxy)
	}
	rt := cfg["plugins"].(map[string]any)["io.containerd.cri.v1.runtime"].(map[string]any)["containerd"].(map[string]any)["runtimes"].(map[string]any)["tidepool"].(map[string]any)
	if rt["runtime_type"] != "io.containerd.tidepool.v1" || rt["snapshotter"] != "tidepool" {
		t.Errorf("CRI runtime: %v", rt)
	}
}

// With --restart-containerd and a host root other than /, install and uninstall run
// systemctl in the host's namespaces through pid 1 (nsenter), in order; here nsenter
// is a script that records its arguments, and the binaries are stand-ins.
func TestInstallRestartsThroughHostPID1(t *testing.T) {
	from, fake, T := t.TempDir(), t.TempDir(), t.TempDir()
	for _, b := range installBinaries {
		body := "#!/bin/sh\necho stand-in\n"
		if b == "tidepoold" {
			body = "#!/bin/sh\necho \"root = '/var/lib/tidepool'\"\n"
		}
		if err := os.WriteFile(filepath.Join(from, b), []byte(body), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	logf := filepath.Join(fake, "calls")
	if err := os.WriteFile(filepath.Join(fake, "nsenter"), []byte("#!/bin/sh\necho \"$*\" >> "+logf+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", fake+":"+os.Getenv("PATH"))
	run := func(args ...string) string {
		cmd := newRootCommand()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetArgs(args)
		if err := cmd.Execute(); err != nil {
			t.Fatalf("tidepool %v: %v\n%s", args, err, out.String())
		}
		return out.String()
	}
	run("install", "--host-root", T, "--from", from, "--restart-containerd")
	run("uninstall", "--host-root", T, "--restart-containerd")
	calls, err := os.ReadFile(logf)
	if err != nil {
		t.Fatal(err)
	}
	want := "--target 1 --mount -- systemctl daemon-reload\n" +
		"--target 1 --mount -- systemctl restart tidepoold\n" +
		"--target 1 --mount -- systemctl restart containerd\n" +
		"--target 1 --mount -- systemctl stop tidepoold\n" +
		"--target 1 --mount -- systemctl daemon-reload\n" +
		"--target 1 --mount -- systemctl restart containerd\n"
	if string(calls) != want {
		t.Fatalf("host commands:\n%s\nwant:\n%s", calls, want)
	}
	// A second install with nothing to change restarts nothing.
	os.Remove(logf)
	run("install", "--host-root", T, "--from", from, "--restart-containerd")
	os.Remove(logf)
	if out := run("install", "--host-root", T, "--from", from, "--restart-containerd"); !strings.Contains(out, "nothing to change") {
		t.Fatalf("second install: %s", out)
	}
	if _, err := os.Stat(logf); err == nil {
		t.Fatal("an install that changed nothing restarted services")
	}
}

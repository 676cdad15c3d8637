package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/containerd/platforms"
	"github.com/spf13/cobra"
)

func init() { commands = append(commands, newInstallCommand, newUninstallCommand) }

// installer puts Tidepool on a host whose root is hostRoot ("/" on the host itself,
// the node's root mounted into a pod under Kubernetes).
type installer struct {
	hostRoot string
	from     string // directory holding the binaries to copy
	dryRun   bool
	restart  bool
	out      io.Writer
}

// manifest is what install wrote, kept at installManifest so uninstall removes
// exactly that. Paths are host paths (without --host-root).
type manifest struct {
	Files []installedFile `json:"files"`
	// Dirs install created, parents first; uninstall removes them if empty.
	Dirs []string `json:"dirs,omitempty"`
	// Imports is the change made to containerd's config, if any.
	Imports *importEdit `json:"imports,omitempty"`
}

type installedFile struct {
	Path   string `json:"path"`
	SHA256 string `json:"sha256,omitempty"` // regular files
	Link   string `json:"link,omitempty"`   // symlinks: their target
	// Backup holds the file that was there before install (restored by uninstall).
	Backup string `json:"backup,omitempty"`
}

// desired is one file install wants on the host.
type desired struct {
	path string
	data []byte
	mode fs.FileMode
	link string // a symlink to this target instead of data
}

func (in *installer) host(p string) string { return filepath.Join(in.hostRoot, p) }

func (in *installer) say(format string, args ...any) { fmt.Fprintf(in.out, format+"\n", args...) }

func newInstallCommand(a *app) *cobra.Command {
	in := &installer{}
	var wait bool
	cmd := &cobra.Command{
		Use:   "install [--host-root DIR] [--dry-run] [--restart-containerd]",
		Short: "Install tidepoold, the shim and containerd's drop-in on this host (or the host at --host-root)",
		Long: `Copies tidepool, tidepoold, containerd-shim-tidepool-v1 and tidepool-holder into
/usr/local/bin, writes /etc/tidepool/tidepoold.toml (the defaults), the systemd unit
/etc/systemd/system/tidepoold.service and its WantedBy links, and the containerd drop-in
/etc/containerd/conf.d/tidepool.toml (proxy snapshotter, transfer unpack entries, CRI
runtime handler "tidepool"). containerd's config.toml is left alone when its imports
already cover the drop-in (containerd 2.x's default config does); otherwise one line is
added or extended. What was written is recorded in /etc/tidepool/install.json, so
running install again changes nothing and uninstall removes exactly that.

Restarting containerd is the operator's call: install prints the commands, or runs them
with --restart-containerd.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			in.out = cmd.OutOrStdout()
			if err := in.setup(); err != nil {
				return err
			}
			if err := in.install(); err != nil {
				return err
			}
			if wait {
				// A DaemonSet's container: stay up, so the pod reads Running, until
				// Kubernetes stops it. Tidepool stays installed.
				ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, os.Interrupt)
				defer stop()
				in.say("installed; waiting for SIGTERM (tidepoold runs under the host's systemd)")
				<-ctx.Done()
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&in.hostRoot, "host-root", "/", "the host's root directory (a node's / mounted into a pod)")
	f.StringVar(&in.from, "from", "", "directory holding the binaries to install (default: this tidepool's directory)")
	f.BoolVar(&in.dryRun, "dry-run", false, "print what would change and change nothing")
	f.BoolVar(&in.restart, "restart-containerd", false, "reload systemd, (re)start tidepoold and restart containerd afterwards")
	f.BoolVar(&wait, "wait", false, "after installing, wait for SIGTERM (the DaemonSet's mode)")
	return cmd
}

func newUninstallCommand(a *app) *cobra.Command {
	in := &installer{}
	cmd := &cobra.Command{
		Use:   "uninstall [--host-root DIR] [--dry-run] [--restart-containerd]",
		Short: "Remove exactly what tidepool install wrote",
		Long: `Reads /etc/tidepool/install.json and removes every file install wrote (restoring any it
replaced), the line it changed in containerd's config, and the directories it created.
A file changed since install is left in place and named. Stop tidepoold first
(systemctl disable --now tidepoold) or pass --restart-containerd, which also stops it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			in.out = cmd.OutOrStdout()
			if err := in.setup(); err != nil {
				return err
			}
			return in.uninstall()
		},
	}
	f := cmd.Flags()
	f.StringVar(&in.hostRoot, "host-root", "/", "the host's root directory (a node's / mounted into a pod)")
	f.BoolVar(&in.dryRun, "dry-run", false, "print what would change and change nothing")
	f.BoolVar(&in.restart, "restart-containerd", false, "stop tidepoold, reload systemd and restart containerd afterwards")
	return cmd
}

func (in *installer) setup() error {
	abs, err := filepath.Abs(in.hostRoot)
	if err != nil {
		return fmt.Errorf("--host-root: %w", err)
	}
	if st, err := os.Stat(abs); err != nil || !st.IsDir() {
		return fmt.Errorf("--host-root %s: not a directory", in.hostRoot)
	}
	in.hostRoot = abs
	return nil
}

func (in *installer) readManifest() (*manifest, error) {
	b, err := os.ReadFile(in.host(installManifest))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", in.host(installManifest), err)
	}
	return &m, nil
}

func (m *manifest) file(path string) *installedFile {
	for i := range m.Files {
		if m.Files[i].Path == path {
			return &m.Files[i]
		}
	}
	return nil
}

func sum(b []byte) string { h := sha256.Sum256(b); return hex.EncodeToString(h[:]) }

// want lists the files install writes.
func (in *installer) want(cfg mainConfig) ([]desired, error) {
	from := in.from
	if from == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		from = filepath.Dir(self)
	}
	var out []desired
	for _, name := range installBinaries {
		b, err := os.ReadFile(filepath.Join(from, name))
		if err != nil {
			return nil, fmt.Errorf("binary to install: %w (pass --from DIR)", err)
		}
		out = append(out, desired{path: filepath.Join(installBinDir, name), data: b, mode: 0o755})
	}
	// tidepoold's own defaults, so the file always matches the daemon installed.
	def, err := exec.Command(filepath.Join(from, "tidepoold"), "--print-default-config").Output()
	if err != nil {
		return nil, fmt.Errorf("tidepoold --print-default-config: %w", err)
	}
	out = append(out,
		desired{path: installDaemonConfig, data: def, mode: 0o644},
		desired{path: installUnit, data: []byte(tidepooldUnit), mode: 0o644},
	)
	for _, w := range unitWants {
		out = append(out, desired{path: w, link: installUnit})
	}
	version := cfg.Version
	if version != 3 && version != 4 {
		version = 3
	}
	out = append(out, desired{path: installDropIn, data: []byte(dropIn(version, platforms.DefaultString())), mode: 0o644})
	return out, nil
}

// install computes what differs from what it wants and changes only that.
func (in *installer) install() error {
	m, err := in.readManifest()
	if err != nil {
		return err
	}
	if m == nil {
		m = &manifest{}
	}
	// containerd's config: read version and imports; plan the one-line edit.
	cfgPath := in.host(containerdConfig)
	cfgData, err := os.ReadFile(cfgPath)
	cfgExists := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	var mc mainConfig
	if cfgExists {
		if mc, err = parseMainConfig(cfgData); err != nil {
			return fmt.Errorf("%s: %w", cfgPath, err)
		}
		if mc.Version != 0 && mc.Version < 3 {
			return fmt.Errorf("%s is config version %d (containerd 1.x): Tidepool needs containerd >= 2.3", cfgPath, mc.Version)
		}
	}
	files, err := in.want(mc)
	if err != nil {
		return err
	}
	var newCfg []byte
	var edit importEdit
	switch {
	case !cfgExists:
		// containerd runs on its built-in defaults, which import nothing: give it
		// a config that imports the drop-in (uninstall removes the file again).
		files = append(files, desired{path: containerdConfig, mode: 0o644,
			data: []byte("# Written by tidepool install: containerd had no config file.\nversion = 3\nimports = ['" + installDropIn + "']\n")})
	case importsDropIn(mc.Imports, containerdConfig, installDropIn):
		// Already imported (the default /etc/containerd/conf.d/*.toml): no edit.
	default:
		if newCfg, edit, err = addImport(cfgData, installDropIn); err != nil {
			return fmt.Errorf("%s: %w", cfgPath, err)
		}
	}

	changed := false
	for _, d := range files {
		c, err := in.ensure(m, d)
		if err != nil {
			return err
		}
		changed = changed || c
	}
	if newCfg != nil {
		changed = true
		in.say("edit     %s: %q -> %q", containerdConfig, edit.Before, edit.Line)
		if !in.dryRun {
			if err := writeAtomic(cfgPath, newCfg, fileMode(cfgPath, 0o644)); err != nil {
				return err
			}
			m.Imports = &edit
		}
	}
	if !changed {
		in.say("nothing to change: Tidepool is installed under %s", in.hostRoot)
		return nil
	}
	if in.dryRun {
		in.say("dry run: nothing changed")
		return nil
	}
	if err := in.writeManifest(m); err != nil {
		return err
	}
	return in.afterwards(true)
}

// ensure makes one file as wanted, recording it (and any file it replaces).
func (in *installer) ensure(m *manifest, d desired) (bool, error) {
	p := in.host(d.path)
	rec := m.file(d.path)
	if d.link != "" {
		if cur, err := os.Readlink(p); err == nil && cur == d.link {
			return false, nil // as wanted (and, if not recorded, not ours to remove)
		}
	} else if cur, err := os.ReadFile(p); err == nil && bytes.Equal(cur, d.data) && fileMode(p, 0) == d.mode {
		return false, nil
	}
	_, statErr := os.Lstat(p)
	exists := statErr == nil
	verb := "create"
	if exists {
		verb = "replace"
	}
	in.say("%-8s %s", verb, d.path)
	if in.dryRun {
		return true, nil
	}
	if err := in.mkdirs(m, filepath.Dir(d.path)); err != nil {
		return false, err
	}
	if rec == nil {
		m.Files = append(m.Files, installedFile{Path: d.path})
		rec = &m.Files[len(m.Files)-1]
		if exists {
			// Not ours: keep it to put back at uninstall.
			rec.Backup = filepath.Join(installBackups, d.path)
			if err := in.mkdirs(m, filepath.Dir(rec.Backup)); err != nil {
				return false, err
			}
			if err := os.Rename(p, in.host(rec.Backup)); err != nil {
				return false, fmt.Errorf("back up %s: %w", p, err)
			}
		}
	}
	if d.link != "" {
		os.Remove(p)
		if err := os.Symlink(d.link, p); err != nil {
			return false, err
		}
		rec.Link, rec.SHA256 = d.link, ""
		return true, nil
	}
	if err := writeAtomic(p, d.data, d.mode); err != nil {
		return false, err
	}
	rec.SHA256, rec.Link = sum(d.data), ""
	return true, nil
}

// mkdirs creates dir and missing parents under the host root, recording each.
func (in *installer) mkdirs(m *manifest, dir string) error {
	var missing []string
	for d := dir; d != "/" && d != "."; d = filepath.Dir(d) {
		if _, err := os.Stat(in.host(d)); err == nil {
			break
		}
		missing = append([]string{d}, missing...)
	}
	for _, d := range missing {
		if err := os.Mkdir(in.host(d), 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		m.Dirs = append(m.Dirs, d)
	}
	return nil
}

func (in *installer) writeManifest(m *manifest) error {
	if err := in.mkdirs(m, filepath.Dir(installManifest)); err != nil {
		return err
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(in.host(installManifest), append(b, '\n'), 0o600)
}

func (in *installer) uninstall() error {
	m, err := in.readManifest()
	if err != nil {
		return err
	}
	if m == nil {
		in.say("nothing to remove: no %s under %s", installManifest, in.hostRoot)
		return nil
	}
	if in.restart && !in.dryRun {
		in.hostCommand("systemctl", "stop", "tidepoold")
	}
	var kept []string
	for i := len(m.Files) - 1; i >= 0; i-- {
		f := m.Files[i]
		p := in.host(f.Path)
		mine := false
		if f.Link != "" {
			cur, err := os.Readlink(p)
			mine = err == nil && cur == f.Link
		} else if b, err := os.ReadFile(p); err == nil {
			mine = sum(b) == f.SHA256
		} else if errors.Is(err, fs.ErrNotExist) {
			mine = true // already gone
		}
		if !mine {
			in.say("keep     %s (changed since install)", f.Path)
			kept = append(kept, f.Path)
			continue
		}
		verb := "remove"
		if f.Backup != "" {
			verb = "restore"
		}
		in.say("%-8s %s", verb, f.Path)
		if in.dryRun {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		if f.Backup != "" {
			if err := os.Rename(in.host(f.Backup), p); err != nil {
				return fmt.Errorf("restore %s: %w", f.Path, err)
			}
		}
	}
	if m.Imports != nil {
		cfgPath := in.host(containerdConfig)
		data, err := os.ReadFile(cfgPath)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		if out, ok := removeImport(data, *m.Imports); ok {
			in.say("edit     %s: %q -> %q", containerdConfig, m.Imports.Line, m.Imports.Before)
			if !in.dryRun {
				if err := writeAtomic(cfgPath, out, fileMode(cfgPath, 0o644)); err != nil {
					return err
				}
			}
		} else {
			in.say("keep     %s: the line %q is no longer there", containerdConfig, m.Imports.Line)
		}
	}
	if in.dryRun {
		in.say("dry run: nothing changed")
		return nil
	}
	if len(kept) > 0 {
		// Keep the manifest for what is left, so a later uninstall can finish.
		return fmt.Errorf("left in place, changed since install: %s", strings.Join(kept, ", "))
	}
	if err := os.Remove(in.host(installManifest)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for i := len(m.Dirs) - 1; i >= 0; i-- {
		// Only if empty: anything else put there since is not ours to delete.
		if err := os.Remove(in.host(m.Dirs[i])); err == nil {
			in.say("remove   %s/", m.Dirs[i])
		}
	}
	return in.afterwards(false)
}

// afterwards reloads systemd and restarts what must pick the change up, or prints
// the commands.
func (in *installer) afterwards(installed bool) error {
	cmds := [][]string{{"systemctl", "daemon-reload"}}
	if installed {
		cmds = append(cmds, []string{"systemctl", "restart", "tidepoold"})
	}
	cmds = append(cmds, []string{"systemctl", "restart", "containerd"})
	if !in.restart {
		in.say("\nto activate, run on the host:")
		for _, c := range cmds {
			in.say("  %s", strings.Join(c, " "))
		}
		return nil
	}
	for _, c := range cmds {
		if err := in.hostCommand(c...); err != nil {
			return err
		}
	}
	return nil
}

// hostCommand runs a command on the host: directly when --host-root is /, else in
// the host's mount namespace through pid 1 (a pod with hostPID, as the DaemonSet).
func (in *installer) hostCommand(args ...string) error {
	if in.hostRoot != "/" {
		args = append([]string{"nsenter", "--target", "1", "--mount", "--"}, args...)
	}
	in.say("run      %s", strings.Join(args, " "))
	cmd := exec.CommandContext(context.Background(), args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = in.out, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w", strings.Join(args, " "), err)
	}
	return nil
}

func fileMode(p string, def fs.FileMode) fs.FileMode {
	if st, err := os.Stat(p); err == nil {
		return st.Mode().Perm()
	}
	return def
}

// writeAtomic writes a file through a temp file and rename, so containerd or
// systemd never read half of one.
func writeAtomic(p string, data []byte, mode fs.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), p)
}

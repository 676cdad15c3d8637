package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/hostcheck"
	"github.com/tidepool-dev/tidepool/internal/runcmd"
)

func init() { commands = append(commands, newDoctorCommand) }

// doctor checks a host for everything Tidepool needs.
type doctor struct {
	app               *app
	containerdAddress string
	snapshotter       string
	handler           string
	jsonOut           bool
}

// doctorReport is `tidepool doctor --json`.
type doctorReport struct {
	OK     bool              `json:"ok"`
	Checks []hostcheck.Check `json:"checks"`
}

func newDoctorCommand(a *app) *cobra.Command {
	d := &doctor{app: a}
	cmd := &cobra.Command{
		Use:   "doctor [--json]",
		Short: "Check this host for everything Tidepool needs, and say how to fix what is missing",
		Long: `Checks the kernel (overlayfs with data-only lowers and metacopy, EROFS file-backed
mounts, FUSE and FUSE passthrough, cgroups and the freezer, trusted.* xattrs on the
root's filesystem) by doing what Tidepool does on private scratch mounts; asks the
running containerd through its API whether it loads the tidepool proxy snapshotter,
unpacks images for it (a tiny image imported into a namespace of its own, removed
afterwards), can start the tidepool runtime, and (with CRI) has the runtime handler;
looks up the shim's routes (runc, runsc, delegate shims) on containerd's PATH; and asks
tidepoold for its state and pools. One line per check: ok, missing or degraded, and
the fix. Exits 1 when a required check is not ok. Run as root.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rep := d.run(cmd.Context())
			if d.jsonOut {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(rep); err != nil {
					return err
				}
			} else {
				printChecks(cmd.OutOrStdout(), rep.Checks)
			}
			if !rep.OK {
				if !d.jsonOut {
					fmt.Fprintln(os.Stderr, "tidepool doctor: a required check failed")
				}
				return runcmd.ExitError{Status: 1}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&d.jsonOut, "json", false, "print the checks as JSON")
	f.StringVar(&d.containerdAddress, "containerd-address", "/run/containerd/containerd.sock", "containerd's gRPC socket")
	f.StringVar(&d.snapshotter, "snapshotter", "tidepool", "name of the tidepool proxy snapshotter in containerd's config")
	f.StringVar(&d.handler, "runtime-handler", "tidepool", "name of the CRI runtime handler (RuntimeClass handler)")
	return cmd
}

func (d *doctor) run(ctx context.Context) doctorReport {
	checks := hostcheck.Host(ctx, hostcheck.Options{Root: d.app.root})
	views := hostcheck.Check{Name: "kernel views (views.mode = auto)", Status: hostcheck.OK,
		Detail: "auto picks kernel views (EROFS image + overlayfs data-only lower)"}
	if err := hostcheck.KernelViews(ctx, d.app.root); err != nil {
		views.Status, views.Detail = hostcheck.Degraded, "auto picks FUSE views: "+strings.TrimPrefix(err.Error(), "kernel views unavailable: ")
		views.Fix = "see the failed kernel checks above; FUSE views work meanwhile"
	}
	checks = append(checks, views)
	cc, facts := d.checkContainerd(ctx)
	checks = append(checks, cc...)
	checks = append(checks, d.checkRoutes(facts)...)
	checks = append(checks, d.checkDaemon(ctx, facts)...)
	if facts.client != nil {
		facts.client.Close()
	}
	rep := doctorReport{OK: true, Checks: checks}
	for i, c := range checks {
		if c.OK() {
			checks[i].Fix = "" // nothing to fix
		}
		if c.Failed() {
			rep.OK = false
		}
	}
	return rep
}

// checkDaemon finds the tidepoold owning the root (ROOT/tidepoold.json, or
// --api-address), asks it for its state and pools, and compares its root with the
// one containerd's proxy plugin exports.
func (d *doctor) checkDaemon(ctx context.Context, facts containerdFacts) []hostcheck.Check {
	c := hostcheck.Check{Name: "tidepoold", Required: true,
		Fix: "start tidepoold (systemctl start tidepoold; tidepool install writes its unit), or pass --root / --api-address"}
	cl, err := d.app.dialDaemon(ctx)
	if err != nil || cl == nil {
		if err == nil {
			err = fmt.Errorf("no tidepoold runs for root %s (no live %s)", d.app.root, filepath.Join(d.app.root, "tidepoold.json"))
		}
		return []hostcheck.Check{fail(c, hostcheck.Missing, err)}
	}
	d.app.api = cl
	d.app.closers = append(d.app.closers, cl.Close)
	info, err := cl.Info(ctx)
	if err != nil {
		return []hostcheck.Check{fail(c, hostcheck.Missing, fmt.Errorf("Info: %w", err))}
	}
	c.Status, c.Fix = hostcheck.OK, ""
	c.Detail = fmt.Sprintf("pid %d, root %s, snapshotter %s", info.GetPid(), info.GetRoot(), info.GetSnapshotterAddress())
	if v := info.GetVersion(); v != "" {
		c.Detail = v + ", " + c.Detail
	}
	if mode := daemonViewMode(d.app.root); mode != "" {
		c.Detail += ", view mode " + mode
	}
	out := []hostcheck.Check{c}
	if want := facts.exports["root"]; want != "" && info.GetRoot() != "" && filepath.Clean(want) != filepath.Clean(info.GetRoot()) {
		out = append(out, hostcheck.Check{Name: "containerd and tidepoold agree on the root", Status: hostcheck.Degraded,
			Detail: fmt.Sprintf("proxy plugin exports root %s, tidepoold's root is %s", want, info.GetRoot()),
			Fix:    "make [proxy_plugins.tidepool.exports] root equal tidepoold's root"})
	}
	pools := hostcheck.Check{Name: "pools"}
	list, err := cl.ListPools(ctx)
	switch {
	case err != nil:
		pools = fail(pools, hostcheck.Degraded, err)
	case len(list) == 0:
		pools.Status, pools.Detail = hostcheck.OK, "none configured ([[pools.template]] in tidepoold's config)"
	default:
		pools.Status = hostcheck.OK
		var parts []string
		for _, p := range list {
			parts = append(parts, fmt.Sprintf("%s %d/%d idle", p.Name, p.Idle, p.Target))
			if p.Idle < p.Min {
				pools.Status = hostcheck.Degraded
				pools.Fix = "a pool is below its minimum: see tidepoold's log and tidepool_pool_* metrics"
			}
		}
		pools.Detail = strings.Join(parts, ", ")
	}
	return append(out, pools)
}

// daemonViewMode is the view mode tidepoold records in its state file, if it does.
func daemonViewMode(root string) string {
	b, err := os.ReadFile(filepath.Join(root, "tidepoold.json"))
	if err != nil {
		return ""
	}
	var st struct {
		ViewMode string `json:"view_mode"`
	}
	if json.Unmarshal(b, &st) != nil {
		return ""
	}
	return st.ViewMode
}

func printChecks(w io.Writer, checks []hostcheck.Check) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range checks {
		line := fmt.Sprintf("%s\t%s\t%s", c.Status, c.Name, c.Detail)
		if !c.OK() && c.Fix != "" {
			line += " -- fix: " + c.Fix
		}
		if c.Failed() {
			line += " [required]"
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
}

package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/gc"
)

func init() { commands = append(commands, newGCCommand) }

func newGCCommand(a *app) *cobra.Command {
	var (
		grace  time.Duration
		dryRun bool
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Remove objects no fork, pin or snapshot can reach",
		Long: `Mark every object reachable from a live root (each fork's base, current root and
recent history, pins, the roots of mounted kernel views, and the roots of active
snapshots when tidepoold runs) and
remove the rest, except objects written or reused within --grace: a commit running
alongside may be about to reference them. Stale temp files go too. Reachable
objects that are missing are listed; they do not stop the sweep. --grace 0 removes
every unreachable object. A root recorded by a fork, commit or pin is never
collected, even with --grace 0 and writers running; a root nothing records yet (an
ingest not yet forked) may be, and forking it then fails with "not in the store".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if grace < 0 {
				return fmt.Errorf("--grace %s is negative: %w", grace, errdefs.ErrInvalidArgument)
			}
			s, err := a.openStore()
			if err != nil {
				return err
			}
			kernelRoots, err := kernelViewRoots(a)
			if err != nil {
				return err
			}
			opts := gc.Options{Grace: grace, DryRun: dryRun, Roots: kernelRoots}
			if grace == 0 {
				opts.Grace = -1 // gc.Options reads 0 as "default"
			}
			res, err := gc.Collect(ctx, s, liveRootSource{ctx, a}, opts)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			verb := "swept"
			if dryRun {
				verb = "would sweep"
			}
			fmt.Fprintf(w, "marked %d objects from %d roots\n", res.Marked, res.Roots)
			fmt.Fprintf(w, "%s %d objects, %d bytes\n", verb, res.Swept, res.BytesFreed)
			fmt.Fprintf(w, "kept %d unreachable objects younger than %s\n", res.Young, grace)
			if !dryRun {
				fmt.Fprintf(w, "removed %d stale temp files\n", res.TempSwept)
			}
			printProblems(w, "missing", res.Missing)
			printProblems(w, "undecodable", res.Undecodable)
			if n := len(res.Missing); n > 0 {
				fmt.Fprintf(cmd.ErrOrStderr(), "tidepool: warning: %d reachable objects are missing (see `tidepool fsck`)\n", n)
			}
			return nil
		},
	}
	cmd.Flags().DurationVar(&grace, "grace", gc.DefaultGrace, "keep unreachable objects written or reused this recently")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report what would be removed, remove nothing")
	return cmd
}

// liveRootSource adapts the app's live-root lookup (database or daemon) to gc.
type liveRootSource struct {
	ctx context.Context
	a   *app
}

func (l liveRootSource) LiveRoots() ([]casstore.Hash, error) { return l.a.liveRoots(l.ctx) }

// printProblems lists reachability problems, one per line:
// KIND blob|tree HASH ROOT:PATH: error.
func printProblems(w io.Writer, kind string, ps []gc.Problem) {
	for _, p := range ps {
		fmt.Fprintf(w, "%s %s\n", kind, p)
	}
}

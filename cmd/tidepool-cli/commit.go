package main

import (
	"fmt"
	"time"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

func init() { commands = append(commands, newCommitCommand) }

func newCommitCommand(a *app) *cobra.Command {
	var base, upper, prefix string
	var strict, noSpecial bool
	cmd := &cobra.Command{
		Use:   "commit --base ROOT|FORK --upper DIR [--prefix P] [--lunar-strict]",
		Short: "Record an overlay upper directory's changes on top of a root or fork",
		Long: `Commit turns the changes an overlayfs upper directory holds into a new root, reading
only what changed: whiteouts delete, opaque directories replace, new and copied-up
files are stored. --prefix is where the tree sits inside the upper (e.g. "app"); changes
outside it are ignored. The new root is printed on stdout. If --base names a fork, the
fork is advanced to the new root, provided nobody moved it since it was read. A
tidepoold running on the store prepares the new root's kernel views in the background;
while none runs, the root is recorded in ROOT/arrivals for the next one to start.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if err := ingest.ValidatePrefix(prefix); err != nil {
				return fmt.Errorf("--prefix: %w", err)
			}
			target, err := a.resolve(ctx, base)
			if err != nil {
				return err
			}
			store, err := a.openStore()
			if err != nil {
				return err
			}
			stderr := cmd.ErrOrStderr()
			bar := newProgressBar(stderr, "committing")
			start := time.Now()
			opts := ingest.Options{LunarStrict: strict, Strict: noSpecial, Progress: bar.update}
			if f := target.Fork; f != nil {
				// The fork moves while the new objects are still held against garbage
				// collection, so a collection can never sweep them before they are live.
				// A retry after a lost answer is safe: the advance is a compare-and-swap,
				// and a fork found at the new root already took it.
				opts.Record = func(root casstore.Hash) error {
					retried := false
					err := a.retryLost(ctx, func(svc forks.Service) error {
						_, err := svc.Advance(ctx, f.ID, target.Root, root, "commit")
						if err != nil && retried && errdefs.IsFailedPrecondition(err) {
							if cur, gerr := svc.Get(ctx, f.ID); gerr == nil && cur.Root == root {
								return nil
							}
						}
						retried = true
						return err
					})
					if err != nil {
						return fmt.Errorf("%w (the new root %s is stored but not recorded)", err, root)
					}
					return nil
				}
			}
			root, st, err := ingest.UpperStats(ctx, store, target.Root, upper, prefix, opts)
			bar.done()
			if err != nil {
				return err
			}
			warnSpecial(stderr, st.Special)
			if target.Fork == nil {
				a.announce(ctx, root)
			} else {
				a.forkMovedTo(ctx, root)
			}
			if f := target.Fork; f != nil {
				fmt.Fprintf(stderr, "fork %s: %s -> %s in %s\n", f.ID, target.Root.Short(), root.Short(), time.Since(start).Round(time.Millisecond))
			} else {
				fmt.Fprintf(stderr, "committed %s over %s in %s\n", upper, target.Root.Short(), time.Since(start).Round(time.Millisecond))
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), root)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&base, "base", "", "root hash or fork (id or label) the upper directory was made over (required)")
	f.StringVar(&upper, "upper", "", "overlayfs upper directory holding the changes (required)")
	f.StringVar(&prefix, "prefix", "", `where the tree sits inside the upper, e.g. "app" ("" = the upper's root)`)
	f.BoolVar(&strict, "lunar-strict", false, "LunarFS rules: symlinks are dropped (the base must be a --lunar-strict root)")
	f.BoolVar(&noSpecial, "strict", false, "refuse FIFOs, sockets and device nodes in the upper instead of leaving them out")
	_ = cmd.MarkFlagRequired("base")
	_ = cmd.MarkFlagRequired("upper")
	return cmd
}

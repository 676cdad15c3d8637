package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore/checkout"
)

func init() { commands = append(commands, newCheckoutCommand) }

func newCheckoutCommand(a *app) *cobra.Command {
	var opts checkout.Options
	cmd := &cobra.Command{
		Use:   "checkout ROOT|FORK DIR",
		Short: "Write a tree out as ordinary files",
		Long: `Materialize a root or fork into DIR, which must not exist or be empty: directories
0755, files 0644 or 0755, symlinks with their stored targets, every object verified.
With --prefix P the tree lands in DIR/P. On failure nothing is left behind.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			s, t, err := a.target(ctx, args[0])
			if err != nil {
				return err
			}
			opts.Limits = a.limits
			st, err := checkout.Checkout(ctx, s, t.Root, args[1], opts)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "checked out %s: %d files, %d directories, %d symlinks, %d bytes\n",
				t.Root.Short(), st.Files, st.Dirs, st.Symlinks, st.Bytes)
			return nil
		},
	}
	cmd.Flags().StringVar(&opts.Prefix, "prefix", "", "place the tree under DIR/PREFIX (relative path)")
	return cmd
}

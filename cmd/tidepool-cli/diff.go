package main

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore/treediff"
)

func init() { commands = append(commands, newDiffCommand) }

func newDiffCommand(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "diff A B",
		Short: "List the changes between two roots or forks",
		Long: `List what changed from A to B (each a root hash or a fork), one line per leaf
(file, symlink or empty directory), sorted by path:
  A PATH  added          M PATH  content changed
  D PATH  deleted        T PATH  type or mode changed (e.g. chmod +x, file <-> symlink)
A directory replaced by a file, or the reverse, is a deletion of every leaf on one
side and an addition of every leaf on the other. Only subtrees that differ are read.
With --json, an array of {status, path, old_mode, new_mode, old_hash, new_hash}, with
null for the side that does not exist.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			ta, err := a.resolve(ctx, args[0])
			if err != nil {
				return err
			}
			s, tb, err := a.target(ctx, args[1]) // both arguments resolved before the store opens
			if err != nil {
				return err
			}
			changes, err := treediff.DiffLimited(ctx, s, ta.Root, tb.Root, a.limits)
			if err != nil {
				return err
			}
			var out bytes.Buffer
			if asJSON {
				if changes == nil {
					changes = []treediff.Change{}
				}
				enc := json.NewEncoder(&out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(changes); err != nil {
					return err
				}
			} else {
				for _, c := range changes {
					fmt.Fprintf(&out, "%c %s\n", c.Status, quotePath(c.Path))
				}
			}
			_, err = cmd.OutOrStdout().Write(out.Bytes())
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

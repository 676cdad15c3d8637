package main

import (
	"fmt"
	"io"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
)

func init() { commands = append(commands, newCatCommand) }

func newCatCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "cat ROOT|FORK PATH",
		Short: "Print a file of a tree",
		Long: `Print the content of the file at PATH in a root or fork to stdout. The object is
verified against its hash before the first byte is written, so a corrupt or missing
object prints nothing and fails. For a symlink, the link target is printed.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			s, t, err := a.target(ctx, args[0])
			if err != nil {
				return err
			}
			e, p, err := lookupPath(s, t.Root, args[1])
			if err != nil {
				return err
			}
			if e.Mode.IsDir() {
				return fmt.Errorf("%s is a directory: %w", displayPath(p), errdefs.ErrInvalidArgument)
			}
			if e.Hash == casstore.EmptyHash {
				return nil // known content: nothing to read or print
			}
			f, err := s.Open(e.Hash) // verified before it is returned
			if err != nil {
				return fmt.Errorf("%s: %w", displayPath(p), err)
			}
			defer f.Close()
			if _, err := io.Copy(cmd.OutOrStdout(), f); err != nil {
				return fmt.Errorf("write %s: %w", displayPath(p), err)
			}
			return nil
		},
	}
}

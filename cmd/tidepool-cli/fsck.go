package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore/fsck"
)

func init() { commands = append(commands, newFsckCommand) }

func newFsckCommand(a *app) *cobra.Command {
	var opts fsck.Options
	cmd := &cobra.Command{
		Use:   "fsck",
		Short: "Verify every object and what live roots reach",
		Long: `Re-hash every object in the store against its name, and check that every object a
live root reaches exists and that every reachable tree decodes. Problems are listed
on stdout, one per line:
  corrupt HASH: ... (the bytes hash to something else)
  missing blob|tree HASH at ROOT:PATH: ...
  undecodable tree HASH at ROOT:PATH: ... (a tree Tidepool's codec refuses)
  unreadable tree HASH at ROOT:PATH: ...   (a reachable tree that cannot be read)
  leftover temp file PATH ...              (staged by a process that died; harmless,
                                            removed by the next writer or tidepoold's start)
With --quarantine, corrupt objects are moved to STORE/.quarantine/ (they then count
as missing). The exit status is non-zero when anything is wrong.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			s, err := a.openStore()
			if err != nil {
				return err
			}
			r, err := fsck.Check(ctx, s, liveRootSource{ctx, a}, opts)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "checked %d objects, %d bytes, %d live roots\n", r.Objects, r.Bytes, r.Roots)
			for _, b := range r.Bad {
				fmt.Fprintf(w, "corrupt %s\n", b)
			}
			printProblems(w, "missing", r.Missing)
			printProblems(w, "undecodable", r.Undecodable)
			printProblems(w, "unreadable", r.Unreadable)
			for _, t := range r.Leftovers {
				fmt.Fprintf(w, "leftover temp file %s (%d bytes): its writer (pid %d) is gone; the next writer removes it\n", t.Path, t.Size, t.PID)
			}
			if r.Healthy() {
				return nil
			}
			var parts []string
			for _, c := range []struct {
				n    int
				what string
			}{{len(r.Bad), "corrupt"}, {len(r.Missing), "missing"}, {len(r.Undecodable), "undecodable"}, {len(r.Unreadable), "unreadable"}} {
				if c.n > 0 {
					parts = append(parts, fmt.Sprintf("%d %s", c.n, c.what))
				}
			}
			return fmt.Errorf("fsck found problems: %s objects", strings.Join(parts, ", "))
		},
	}
	cmd.Flags().BoolVar(&opts.Quarantine, "quarantine", false, "move corrupt objects to STORE/.quarantine/")
	return cmd
}

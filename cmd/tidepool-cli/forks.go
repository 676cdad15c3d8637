package main

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore/forks"
)

func init() { commands = append(commands, newForksCommand) }

func newForksCommand(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "forks",
		Short: "List forks",
		Long: `List every fork, oldest first: a table (ID, LABEL, ROOT, CREATED, TTL), or with
--json an array of fork records (id, label, base, root, created, updated, ttl,
labels, history).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			svc, err := a.openForks(ctx)
			if err != nil {
				return err
			}
			list, err := svc.List(ctx)
			if err != nil {
				return err
			}
			if list == nil {
				list = []*forks.Fork{} // "[]", not "null"
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(list)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tLABEL\tROOT\tCREATED\tTTL")
			for _, f := range list {
				ttl := "-"
				if f.TTL > 0 {
					ttl = time.Duration(f.TTL).String()
				}
				label := f.Label
				if label == "" {
					label = "-"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", f.ID, quotePath(label), f.Root.Short(),
					f.Created.Local().Format(time.RFC3339), ttl)
			}
			return w.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.AddCommand(newForksRmCommand(a))
	return cmd
}

func newForksRmCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "rm ID|LABEL...",
		Short: "Remove forks",
		Long: `Remove fork records. Every argument is resolved first, so an unknown one removes
nothing. The objects the forks pointed at stay until the next gc.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			svc, err := a.openForks(ctx)
			if err != nil {
				return err
			}
			ids := make([]string, 0, len(args))
			seen := map[string]bool{}
			for _, ref := range args {
				f, err := svc.Get(ctx, ref)
				if err != nil {
					return err
				}
				if !seen[f.ID] {
					seen[f.ID] = true
					ids = append(ids, f.ID)
				}
			}
			for _, id := range ids {
				if err := svc.Remove(ctx, id); err != nil {
					return fmt.Errorf("remove fork %s: %w", id, err)
				}
			}
			return nil
		},
	}
}

package main

import (
	"fmt"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/internal/branchcmd"
)

func init() { commands = append(commands, newForkCommand) }

func newForkCommand(a *app) *cobra.Command {
	var (
		req forks.CreateRequest
		kvs []string
		br  branchFlags
	)
	cmd := &cobra.Command{
		Use:   "fork ROOT|FORK | fork --container ID [--count N] [--namespace NS] [--json]",
		Short: "Make a fork of a root, or branch a running container, and print the fork ids",
		Long: `Create a fork whose base and current root are ROOT (or the current root of FORK).
This writes one record and never reads the tree, so it costs the same for any tree
size; the root must be in the store. The new fork id goes to stdout.

With --container, branch a running container whose rootfs is a tidepool snapshot
with a fork: tidepoold freezes its task, commits its current changes under the
workdir on top of the root it started from into --count new forks (O(changed)),
and resumes it, also on error. The container keeps running as if nothing happened;
its own fork and its commit on removal are untouched. One line per new fork goes to
stdout: ID ROOT LABEL; --json prints the whole answer (forks, the container's own
binding, the pause). Continue a branch in a warm pool member with
` + "`tidepool run --pool P --fork ID -- ...`" + `. Needs a running tidepoold.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if br.container != "" {
				return cobra.NoArgs(cmd, args)
			}
			return cobra.ExactArgs(1)(cmd, args)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := checkLabel(req.Label); err != nil {
				return err
			}
			labels, err := parseLabels(kvs)
			if err != nil {
				return err
			}
			req.Labels = labels
			if br.container != "" {
				return a.forkContainer(cmd, req, br)
			}
			if cmd.Flags().Changed("count") || cmd.Flags().Changed("namespace") || br.json {
				return fmt.Errorf("--count, --namespace and --json go with --container: %w", errdefs.ErrInvalidArgument)
			}
			s, t, err := a.target(ctx, args[0])
			if err != nil {
				return err
			}
			if t.Root != casstore.EmptyHash {
				ok, err := s.Has(t.Root)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("root %s is not in the store %s: %w", t.Root, s.Root(), errdefs.ErrNotFound)
				}
			}
			req.Base = t.Root
			if req.RequestID == "" {
				req.RequestID = forks.NewRequestID()
			}
			var f *forks.Fork
			err = a.retryLost(ctx, func(svc forks.Service) error {
				f, err = svc.Create(ctx, req)
				return err
			})
			if err != nil {
				if errdefs.IsUnavailable(err) {
					return fmt.Errorf("%w: the fork may have been created; run again with --request-id %s to get it without making a duplicate", err, req.RequestID)
				}
				return err
			}
			a.forkMovedTo(ctx, t.Root)
			fmt.Fprintln(cmd.OutOrStdout(), f.ID)
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&req.Label, "label", "", "a name to find the fork by (need not be unique)")
	fl.DurationVar(&req.TTL, "ttl", 0, "remove the fork this long after its creation (0: never)")
	fl.StringArrayVar(&kvs, "label-kv", nil, "attach a key=value label (repeatable)")
	fl.StringVar(&br.container, "container", "", "branch this running containerd container (its id) instead of forking a root")
	fl.IntVar(&br.count, "count", 1, "with --container: how many forks to make (labels get -1 ... -N)")
	fl.StringVar(&br.namespace, "namespace", defaultNamespace(), "with --container: its containerd namespace (default $CONTAINERD_NAMESPACE or \"default\")")
	fl.BoolVar(&br.json, "json", false, "with --container: print the answer as JSON")
	fl.StringVar(&req.RequestID, "request-id", "", "make the create idempotent: a fork made earlier with this id is returned instead of a new one (default: a fresh id, also used by automatic retries)")
	return cmd
}

// checkLabel is forks.CheckLabel.
func checkLabel(l string) error { return forks.CheckLabel(l) }

func parseLabels(kvs []string) (map[string]string, error) { return branchcmd.ParseLabels(kvs) }

package main

import (
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
)

func init() { commands = append(commands, newForkCommand) }

func newForkCommand(a *app) *cobra.Command {
	var (
		req forks.CreateRequest
		kvs []string
	)
	cmd := &cobra.Command{
		Use:   "fork ROOT|FORK",
		Short: "Make a fork of a root and print its id",
		Long: `Create a fork whose base and current root are ROOT (or the current root of FORK).
This writes one record and never reads the tree, so it costs the same for any tree
size; the root must be in the store. The new fork id goes to stdout.`,
		Args: cobra.ExactArgs(1),
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
			fmt.Fprintln(cmd.OutOrStdout(), f.ID)
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&req.Label, "label", "", "a name to find the fork by (need not be unique)")
	fl.DurationVar(&req.TTL, "ttl", 0, "remove the fork this long after its creation (0: never)")
	fl.StringArrayVar(&kvs, "label-kv", nil, "attach a key=value label (repeatable)")
	fl.StringVar(&req.RequestID, "request-id", "", "make the create idempotent: a fork made earlier with this id is returned instead of a new one (default: a fresh id, also used by automatic retries)")
	return cmd
}

// checkLabel refuses labels that ROOT|FORK arguments could never resolve to the
// fork: a 64-character string is always read as a root hash, and a label shaped
// like a fork id would be shadowed by a fork with that id.
func checkLabel(l string) error {
	switch {
	case casstore.LooksLikeHash(l):
		return fmt.Errorf("label %q has the length of a root hash and could never be resolved: %w", l, errdefs.ErrInvalidArgument)
	case forks.IsID(l):
		return fmt.Errorf("label %q has the shape of a fork id: %w", l, errdefs.ErrInvalidArgument)
	}
	return nil
}

func parseLabels(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--label-kv %q: want KEY=VALUE: %w", kv, errdefs.ErrInvalidArgument)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("--label-kv: key %q given twice: %w", k, errdefs.ErrInvalidArgument)
		}
		out[k] = v
	}
	return out, nil
}

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/remote"
)

func init() {
	commands = append(commands, newPushCommand, newPullCommand, newRefsCommand, newRefCommand)
}

// remoteFlags are the global flags that say which bucket push, pull and refs use.
type remoteFlags struct {
	cfg remote.Config
	r   *remote.Remote
}

func (rf *remoteFlags) register(f *pflag.FlagSet) {
	f.StringVar(&rf.cfg.URL, "remote", os.Getenv("TIDEPOOL_REMOTE"), "remote bucket s3://BUCKET/PREFIX for push, pull and refs (default $TIDEPOOL_REMOTE); credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
	f.StringVar(&rf.cfg.Endpoint, "remote-endpoint", "", "S3 endpoint for MinIO, R2, RGW: https://HOST[:PORT], or http://HOST:PORT for plain HTTP (default $AWS_ENDPOINT_URL, then $AWS_ENDPOINT, then AWS)")
	f.StringVar(&rf.cfg.Region, "remote-region", "", "S3 region (default $AWS_REGION, then us-east-1)")
	f.BoolVar(&rf.cfg.NoPacks, "remote-no-packs", false, "keep to LunarFS's bucket layout alone: push writes no pack (PREFIX/packs/ROOT), pull reads none and fetches every object with its own GET")
}

func (a *app) openRemote() (*remote.Remote, error) {
	if a.remote.r == nil {
		if a.remote.cfg.URL == "" {
			return nil, fmt.Errorf("no remote: pass --remote s3://BUCKET/PREFIX (or set TIDEPOOL_REMOTE): %w", errdefs.ErrInvalidArgument)
		}
		r, err := remote.Open(a.remote.cfg)
		if err != nil {
			return nil, err
		}
		a.remote.r = r
	}
	return a.remote.r, nil
}

func newPushCommand(a *app) *cobra.Command {
	var ref, expect string
	cmd := &cobra.Command{
		Use:   "push ROOT|FORK [--ref NAME] [--expect ROOT]",
		Short: "Upload a root to the remote and move a ref to it",
		Long: `Push uploads every object of ROOT (or FORK's current root) that the remote bucket
lacks, children before parents, so a tree in the bucket always has its whole subtree
there; subtrees the bucket holds are skipped, so a push after a small commit costs
requests in proportion to what changed. The uploaded objects are also written as one
pack, PREFIX/packs/ROOT, so that a pull can fetch them with one GET. With --ref (default: the fork's
` + binding.ForkLabelRemoteRef + ` label) the ref then moves by compare-and-swap: from the root
given by --expect, or else from the root it had when the push read it. If another
writer moved it first, the root is kept as the conflict ref NAME@conflict-<8 hex>,
whose name is printed on stdout, and push exits non-zero; nothing is lost.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			r, err := a.openRemote()
			if err != nil {
				return err
			}
			s, t, err := a.target(ctx, args[0])
			if err != nil {
				return err
			}
			opts := remote.PushOptions{Ref: ref}
			if f := t.Fork; f != nil {
				if opts.Ref == "" {
					opts.Ref = f.Labels[binding.ForkLabelRemoteRef]
				}
				opts.Base = f.Base
			}
			if expect != "" {
				h, err := casstore.ParseHash(expect)
				if err != nil {
					return fmt.Errorf("--expect: %w", err)
				}
				opts.Expect = &h
			}
			if opts.Expect != nil && opts.Ref == "" {
				return fmt.Errorf("--expect needs --ref: %w", errdefs.ErrInvalidArgument)
			}
			start := time.Now()
			res, err := r.Push(ctx, s, t.Root, opts)
			var conflict *remote.ConflictError
			if errors.As(err, &conflict) {
				fmt.Fprintln(cmd.OutOrStdout(), conflict.ConflictRef)
				return err
			}
			if err != nil {
				return err
			}
			stderr := cmd.ErrOrStderr()
			fmt.Fprintf(stderr, "pushed %s to %s: %d objects (%s) uploaded, %d requests, %s\n", t.Root.Short(), r,
				res.Objects, humanBytes(res.Bytes), res.Requests, time.Since(start).Round(time.Millisecond))
			if res.Ref != "" {
				prev := "(created)"
				if !res.Previous.IsZero() {
					prev = res.Previous.Short()
				}
				fmt.Fprintf(stderr, "ref %s: %s -> %s\n", res.Ref, prev, t.Root.Short())
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), t.Root)
			return err
		},
	}
	cmd.Flags().StringVar(&ref, "ref", "", "ref to move to the pushed root")
	cmd.Flags().StringVar(&expect, "expect", "", "root the ref must still point at (compare-and-swap); the ref must exist")
	return cmd
}

func newPullCommand(a *app) *cobra.Command {
	var (
		makeFork bool
		label    string
	)
	cmd := &cobra.Command{
		Use:   "pull REF|ROOT [--fork [--label L]]",
		Short: "Fetch a ref's (or a root's) objects from the remote into the store",
		Long: `Pull fetches every object of the ref's current root (or ROOT) that the local store
lacks. When much is missing it streams the root's pack (PREFIX/packs/ROOT, written by
the push beside the blobs) and the packs of the roots that one was diffed against, and
fetches what they do not hold object by object, in parallel. Each object is hashed
before it is stored and refused if its bytes do not match its name (a bad pack entry is
fetched again on its own); objects land whole (temp file, sync, rename), so an
interrupted pull keeps what it verified and a re-run fetches only the rest. The root is printed on
stdout. --fork also makes a local fork of it (its id on stdout instead), labelled with
the ref so that ` + "`tidepool push FORK`" + ` pushes back to it.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			r, err := a.openRemote()
			if err != nil {
				return err
			}
			var root casstore.Hash
			refName := ""
			if casstore.LooksLikeHash(args[0]) {
				if root, err = casstore.ParseHash(args[0]); err != nil {
					return err
				}
			} else {
				refName = args[0]
				if root, err = r.ResolveRef(ctx, refName); err != nil {
					return err
				}
			}
			if label != "" {
				if err := checkLabel(label); err != nil {
					return err
				}
			}
			s, err := a.openStore()
			if err != nil {
				return err
			}
			// The pulled objects are durable (in a journal) when Pull returns and reach
			// their names in the background; the command waits for that before it
			// exits, after its output, so it leaves them in LunarFS's layout rather than
			// a journal for the next writer to replay.
			defer s.Settle()
			start := time.Now()
			res, err := r.Pull(ctx, s, root)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "pulled %s from %s: %d objects (%s) fetched, %d present, %d requests (%d packs), %s\n", root.Short(), r,
				res.Objects, humanBytes(res.Bytes), res.Present, res.Requests, res.Packs, time.Since(start).Round(time.Millisecond))
			if !makeFork {
				a.announce(ctx, root) // --fork: the fork's creation tells tidepoold
				_, err = fmt.Fprintln(cmd.OutOrStdout(), root)
				return err
			}
			svc, err := a.openForks(ctx)
			if err != nil {
				return err
			}
			req := forks.CreateRequest{Base: root, Label: label}
			if refName != "" {
				req.Labels = map[string]string{binding.ForkLabelRemoteRef: refName, binding.ForkLabelRemoteRoot: root.String()}
				if req.Label == "" && checkLabel(refName) == nil {
					req.Label = refName
				}
			}
			f, err := svc.Create(ctx, req)
			if err != nil {
				return err
			}
			a.forkMovedTo(ctx, root)
			_, err = fmt.Fprintln(cmd.OutOrStdout(), f.ID)
			return err
		},
	}
	cmd.Flags().BoolVar(&makeFork, "fork", false, "make a local fork of the pulled root and print its id")
	cmd.Flags().StringVar(&label, "label", "", "label of the fork made by --fork (default: the ref's name)")
	return cmd
}

func newRefsCommand(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "refs",
		Short: "List the remote's refs with their roots",
		Long: `List every ref in the remote bucket, conflict refs (NAME@conflict-<8 hex>) included:
a table (NAME, ROOT, CONFLICT OF) or with --json an array of {name, root, conflict_of}.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			r, err := a.openRemote()
			if err != nil {
				return err
			}
			refs, err := r.ListRefs(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(refs)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tROOT\tCONFLICT OF")
			for _, ref := range refs {
				of := ref.Conflict
				if of == "" {
					of = "-"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\n", ref.Name, ref.Root, of)
			}
			return w.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newRefCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "ref", Short: "Manage the remote's refs"}
	cmd.AddCommand(&cobra.Command{
		Use:   "rm NAME",
		Short: "Remove a ref from the remote (its objects stay)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := a.openRemote()
			if err != nil {
				return err
			}
			return r.DeleteRef(cmd.Context(), args[0])
		},
	})
	return cmd
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

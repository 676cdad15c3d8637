package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"github.com/tidepool-dev/tidepool/internal/runcmd"
)

func init() { commands = append(commands, newRunCommand, newPoolsCommand) }

func newRunCommand(a *app) *cobra.Command {
	var o runcmd.Options
	cmd := &cobra.Command{
		Use:   runcmd.Use,
		Short: runcmd.Short,
		Long:  runcmd.Long,
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runcmd.Run(&o, a.root, a.daemonAddress(), args, mainStarted)
		},
	}
	o.Register(cmd.Flags())
	return cmd
}

// mainStarted is when this package was initialized: after every imported package's
// init (GODEBUG=inittrace=1 shows those), just before main.
var mainStarted = time.Now()

func newPoolsCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "pools",
		Short: "List tidepoold's warm pools and their members",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, err := a.daemon(cmd.Context())
			if err != nil {
				return err
			}
			list, err := client.ListPools(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Printf("%-16s %5s %8s %9s %6s %4s %4s  %s\n", "POOL", "IDLE", "CLAIMED", "STARTING", "TARGET", "MIN", "MAX", "IMAGE")
			for _, p := range list {
				fmt.Printf("%-16s %5d %8d %9d %6d %4d %4d  %s\n", p.Name, p.Idle, p.Claimed, p.Starting, p.Target, p.Min, p.Max, p.Image)
			}
			return nil
		},
	}
}

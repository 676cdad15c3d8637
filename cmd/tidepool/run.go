package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/localapi"
)

func init() { commands = append(commands, newRunCommand, newPoolsCommand) }

// exitError makes main exit with a workload's status without printing anything.
type exitError struct{ status int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.status) }

func newRunCommand(a *app) *cobra.Command {
	var (
		poolName, fork, workdir string
		env                     []string
		discard, quiet, timings bool
	)
	cmd := &cobra.Command{
		Use:   "run --pool NAME [--fork ROOT|FORK] [--env K=V]... [--workdir P] -- CMD [ARGS...]",
		Short: "Run a command in a warm pool member with a source fork; exit with its status",
		Long: `Claims a pre-created, frozen member of a tidepoold pool, binds the fork at the pool's
workdir, and runs the command there as the container's workload, with stdin, stdout and
stderr attached and signals forwarded. Exits with the command's exit status (128+N after
a death by signal N). The command's changes under the workdir become the fork's next
root (a bare root gets a new fork), reported on stderr.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if poolName == "" {
				return errors.New("--pool is required")
			}
			tDial := time.Now()
			client, err := a.daemon(cmd.Context())
			if err != nil {
				return err
			}
			sigs := make(chan os.Signal, 4)
			signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
			defer signal.Stop(sigs)
			streams := localapi.RunStreams{Stdout: os.Stdout, Stderr: os.Stderr, Signals: sigs}
			if st, err := os.Stdin.Stat(); err == nil && st.Mode()&os.ModeCharDevice == 0 {
				streams.Stdin = os.Stdin // a pipe or file: forward it; a terminal is not read
			}
			var server []localapi.Step
			if timings {
				streams.Steps = func(s []localapi.Step) { server = s }
			}
			tRun := time.Now()
			exit, err := client.Run(cmd.Context(), &apiv1.RunStart{
				Pool: poolName, Fork: fork, Env: env, Workdir: workdir, Args: args, Discard: discard,
			}, streams)
			if err != nil {
				return err
			}
			if timings {
				printTimings(tDial, tRun, time.Now(), server)
			}
			if !quiet && exit.GetForkId() != "" {
				fmt.Fprintf(os.Stderr, "tidepool: fork %s at %s (member %s, claimed in %.1f ms)\n", exit.GetForkId(), exit.GetRoot(), exit.GetMember(), exit.GetClaimMs())
			}
			if exit.GetStatus() != 0 {
				return exitError{int(exit.GetStatus())}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&poolName, "pool", "", "pool to claim a member of")
	f.StringVar(&fork, "fork", "", "root hash or fork to place at the pool's workdir")
	f.StringArrayVar(&env, "env", nil, "environment entry KEY=VALUE for the command (repeatable)")
	f.StringVar(&workdir, "workdir", "", "the command's working directory (default: the pool's workdir)")
	f.BoolVar(&discard, "discard", false, "do not commit the command's changes to the fork")
	f.BoolVarP(&quiet, "quiet", "q", false, "do not report the fork's new root on stderr")
	f.BoolVar(&timings, "timings", false, "report on stderr where the time went: this process's steps and tidepoold's")
	return cmd
}

// mainStarted is when this package was initialized: after every imported package's
// init (GODEBUG=inittrace=1 shows those), just before main.
var mainStarted = time.Now()

// printTimings reports a run's steps on stderr, in milliseconds: this process's
// (from main to the dial, the dial, the call) and, within the call, tidepoold's.
func printTimings(tDial, tRun, tDone time.Time, server []localapi.Step) {
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64) }
	var b strings.Builder
	fmt.Fprintf(&b, "tidepool: timings (ms): main %s, dial %s, run %s [", ms(tDial.Sub(mainStarted)), ms(tRun.Sub(tDial)), ms(tDone.Sub(tRun)))
	var sum time.Duration
	for i, st := range server {
		if i > 0 {
			b.WriteString(", ")
		}
		sum += st.Duration
		fmt.Fprintf(&b, "%s %s", st.Name, ms(st.Duration))
	}
	fmt.Fprintf(&b, "; transport %s]\n", ms(tDone.Sub(tRun)-sum))
	os.Stderr.WriteString(b.String())
}

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

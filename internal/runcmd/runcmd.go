// Package runcmd is `tidepool run`: its flags, the call on tidepoold's run socket and
// what it prints. Both the front binary (cmd/tidepool, which serves `run` itself so
// that a warm run does not pay the full CLI's start-up) and the full CLI
// (cmd/tidepool-cli, for help and unusual command lines) use it, so the two cannot
// drift. It links the standard library, pflag and runwire only.
package runcmd

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/tidepool-dev/tidepool/localapi/runwire"
)

// Use and Long document the command (the full CLI's help shows them).
const (
	Use   = "run --pool NAME [--fork ROOT|FORK] [--env K=V]... [--workdir P] -- CMD [ARGS...]"
	Short = "Run a command in a warm pool member with a source fork; exit with its status"
	Long  = `Claims a pre-created, frozen member of a tidepoold pool, binds the fork at the pool's
workdir, and runs the command there as the container's workload, with stdin, stdout and
stderr attached and signals forwarded. Exits with the command's exit status (128+N after
a death by signal N). The command's changes under the workdir become the fork's next
root (a bare root gets a new fork), reported on stderr.`
)

// Options are run's own flags.
type Options struct {
	Pool, Fork, Workdir     string
	Env                     []string
	Discard, Quiet, Timings bool
}

// Register adds run's flags to f.
func (o *Options) Register(f *pflag.FlagSet) {
	f.StringVar(&o.Pool, "pool", "", "pool to claim a member of")
	f.StringVar(&o.Fork, "fork", "", "root hash or fork to place at the pool's workdir")
	f.StringArrayVar(&o.Env, "env", nil, "environment entry KEY=VALUE for the command (repeatable)")
	f.StringVar(&o.Workdir, "workdir", "", "the command's working directory (default: the pool's workdir)")
	f.BoolVar(&o.Discard, "discard", false, "do not commit the command's changes to the fork")
	f.BoolVarP(&o.Quiet, "quiet", "q", false, "do not report the fork's new root on stderr")
	f.BoolVar(&o.Timings, "timings", false, "report on stderr where the time went: this process's steps and tidepoold's")
}

// DaemonState is what tidepoold writes to ROOT/tidepoold.json while it runs.
type DaemonState struct {
	PID        int    `json:"pid"`
	Address    string `json:"address"`
	APIAddress string `json:"api_address"`
	ViewMode   string `json:"view_mode"`
}

// StateFile is where tidepoold records itself in its root.
const StateFile = "tidepoold.json"

// APIAddress is the API socket of the tidepoold owning root, as recorded in its state
// file, or "" when none runs (no file, or its process is gone).
func APIAddress(root string) string {
	b, err := os.ReadFile(filepath.Join(root, StateFile))
	if err != nil {
		return ""
	}
	var st DaemonState
	if err := json.Unmarshal(b, &st); err != nil || st.APIAddress == "" {
		return ""
	}
	if st.PID > 0 && syscall.Kill(st.PID, 0) == syscall.ESRCH {
		return "" // a daemon that died without cleaning up
	}
	return st.APIAddress
}

// ExitError makes main exit with a workload's status without printing anything.
type ExitError struct{ Status int }

func (e ExitError) Error() string { return fmt.Sprintf("exit status %d", e.Status) }

// Run runs args in a member as o says, on the tidepoold whose API socket is api ("":
// none runs for root). It returns ExitError for a non-zero workload status.
// mainStarted is when the process reached main, for --timings.
func Run(o *Options, root, api string, args []string, mainStarted time.Time) error {
	if o.Pool == "" {
		return errors.New("--pool is required")
	}
	if len(args) == 0 {
		return errors.New("run: no command (tidepool run --pool NAME -- CMD [ARGS...])")
	}
	if api == "" {
		return fmt.Errorf("no tidepoold runs for root %s (or pass --api-address)", root)
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	stdio := runwire.Stdio{Stdout: os.Stdout, Stderr: os.Stderr}
	if st, err := os.Stdin.Stat(); err == nil && st.Mode()&os.ModeCharDevice == 0 {
		stdio.Stdin = os.Stdin // a pipe or file: the workload reads it; a terminal is not read
	}
	tRun := time.Now()
	exit, err := runwire.Run(runwire.Address(api), runwire.Start{
		Pool: o.Pool, Fork: o.Fork, Env: o.Env, Workdir: o.Workdir, Args: args, Discard: o.Discard,
	}, stdio, sigs, nil)
	if err != nil {
		return err
	}
	if o.Timings {
		printTimings(mainStarted, tRun, time.Now(), exit.Steps)
	}
	if !o.Quiet && exit.ForkID != "" {
		fmt.Fprintf(os.Stderr, "tidepool: fork %s at %s (member %s, claimed in %.1f ms)\n", exit.ForkID, exit.Root, exit.Member, exit.ClaimMs)
	}
	if exit.Status != 0 {
		return ExitError{exit.Status}
	}
	return nil
}

// printTimings reports a run's steps on stderr, in milliseconds: this process's (from
// main to the call, the call) and, within the call, tidepoold's; transport is the
// call's time outside tidepoold's steps (connect, frames, the socket).
func printTimings(mainStarted, tRun, tDone time.Time, server []runwire.Step) {
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64) }
	var b strings.Builder
	fmt.Fprintf(&b, "tidepool: timings (ms): main %s, run %s [", ms(tRun.Sub(mainStarted)), ms(tDone.Sub(tRun)))
	var sum time.Duration
	for i, st := range server {
		if i > 0 {
			b.WriteString(", ")
		}
		d := time.Duration(st.Ms * float64(time.Millisecond))
		sum += d
		fmt.Fprintf(&b, "%s %s", st.Name, ms(d))
	}
	fmt.Fprintf(&b, "; transport %s]\n", ms(tDone.Sub(tRun)-sum))
	os.Stderr.WriteString(b.String())
}

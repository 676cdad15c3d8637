package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

func init() { commands = append(commands, newIngestCommand) }

func newIngestCommand(a *app) *cobra.Command {
	var strict, noSpecial bool
	cmd := &cobra.Command{
		Use:   "ingest [--lunar-strict] PATH",
		Short: "Hash a directory tree into the store and print its root",
		Long: `Ingest hashes the directory tree at PATH into the object store and prints its root
hash as the last line of stdout. The rules are LunarFS's (.git skipped, empty
directories kept, exec bit from any x bit, names made valid UTF-8); symlinks are kept
as symlink entries unless --lunar-strict, which drops them so that the root equals
what 'lunar ingest' prints. Nothing is added to the store unless the whole ingest
succeeds. A tidepoold running on the store is told of the root, so that it prepares
the root's kernel views in the background; while none runs, the root is recorded in
ROOT/arrivals and the next tidepoold to start prepares it.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			store, err := a.openStore()
			if err != nil {
				return err
			}
			stderr := cmd.ErrOrStderr()
			opts := ingest.Options{LunarStrict: strict, Strict: noSpecial}
			bar := newProgressBar(stderr, "ingesting")
			opts.Progress = bar.update
			start := time.Now()
			root, st, err := ingest.Dir(cmd.Context(), store, args[0], opts)
			bar.done()
			if err != nil {
				return err
			}
			a.announce(cmd.Context(), root)
			warnSpecial(stderr, st.Special)
			fmt.Fprintf(stderr, "ingested %d files (%s) in %d directories, %d symlinks, %d skipped, in %s\n",
				st.Files, formatBytes(st.Bytes), st.Dirs, st.Symlinks, st.Skipped, time.Since(start).Round(time.Millisecond))
			_, err = fmt.Fprintln(cmd.OutOrStdout(), root)
			return err
		},
	}
	cmd.Flags().BoolVar(&strict, "lunar-strict", false, "reproduce LunarFS's root exactly: drop symlinks as LunarFS does")
	cmd.Flags().BoolVar(&noSpecial, "strict", false, "refuse FIFOs, sockets and device nodes instead of leaving them out")
	return cmd
}

// warnSpecial says how many special files were left out (each is also logged).
func warnSpecial(w io.Writer, n int64) {
	if n > 0 {
		fmt.Fprintf(w, "tidepool: warning: left out %d FIFOs, sockets or device nodes (trees cannot hold them; --strict refuses them)\n", n)
	}
}

// progressBar draws an ingest's progress on stderr when stderr is a terminal, and is a
// no-op otherwise (logs and pipes get only the summary line).
type progressBar struct {
	bar      *progressbar.ProgressBar
	knownMax bool
}

func newProgressBar(w io.Writer, what string) *progressBar {
	f, ok := w.(*os.File)
	if !ok || !isTerminal(f) {
		return &progressBar{}
	}
	return &progressBar{bar: progressbar.NewOptions64(-1,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowCount(),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionClearOnFinish(),
	)}
}

// update is an ingest.Options.Progress callback: bytes done, against the total once the
// walk has found every file.
func (p *progressBar) update(pr ingest.Progress) {
	if p.bar == nil {
		return
	}
	if pr.WalkDone && !p.knownMax {
		p.bar.ChangeMax64(pr.FoundBytes)
		p.knownMax = true
	}
	_ = p.bar.Set64(pr.Bytes)
}

func (p *progressBar) done() {
	if p.bar != nil {
		_ = p.bar.Clear()
	}
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// formatBytes renders a size for humans ("157.3 MB").
func formatBytes(n int64) string {
	const unit = 1000
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %cB", float64(n)/float64(div), "kMGTPE"[exp])
}

// Command tidepool is the command-line interface to a Tidepool root: it ingests source
// trees into the content-addressed store, makes and lists forks, commits overlay
// changes, diffs roots, mounts fork views and maintains the store. Data goes to
// stdout; progress, logs and errors go to stderr.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/tidepool-dev/tidepool/internal/runcmd"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCommand().ExecuteContext(ctx)
	stop()
	var exit runcmd.ExitError
	switch {
	case errors.As(err, &exit):
		os.Exit(exit.Status)
	case err != nil:
		fmt.Fprintf(os.Stderr, "tidepool: %v\n", err)
		os.Exit(1)
	}
}

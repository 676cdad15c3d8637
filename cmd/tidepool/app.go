package main

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/containerd/log"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// DefaultRoot is where tidepool and tidepoold keep their state unless told otherwise.
const DefaultRoot = "/var/lib/tidepool"

// app holds the global flags and lazily opened resources shared by the commands.
type app struct {
	root     string
	storeDir string
	logLevel string

	store   *casstore.Store
	forks   forks.Service
	closers []func() error
}

func newRootCommand() *cobra.Command {
	a := &app{}
	cmd := &cobra.Command{
		Use:           "tidepool",
		Short:         "Content-addressed source forks for containerd",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := log.SetLevel(a.logLevel); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			return nil
		},
		PersistentPostRunE: func(*cobra.Command, []string) error { return a.close() },
	}
	f := cmd.PersistentFlags()
	f.StringVar(&a.root, "root", DefaultRoot, "Tidepool root directory (store in ROOT/cas, fork database ROOT/forks.db)")
	f.StringVar(&a.storeDir, "store", "", "object store directory, overriding ROOT/cas (e.g. a LunarFS store, ~/.lunar/cas)")
	f.StringVar(&a.logLevel, "log-level", "warn", "log level on stderr (debug, info, warn, error)")
	for _, add := range commands {
		cmd.AddCommand(add(a))
	}
	return cmd
}

// commands is filled by each command's file, so adding a command touches one file.
var commands []func(*app) *cobra.Command

func (a *app) storePath() string {
	if a.storeDir != "" {
		return a.storeDir
	}
	return filepath.Join(a.root, "cas")
}

func (a *app) forksDBPath() string { return filepath.Join(a.root, "forks.db") }

// openStore opens the object store once per invocation.
func (a *app) openStore() (*casstore.Store, error) {
	if a.store == nil {
		s, err := casstore.Open(a.storePath())
		if err != nil {
			return nil, err
		}
		a.store = s
	}
	return a.store, nil
}

// openForks opens the fork database. Expired forks are swept on the way, so a TTL is
// enforced by whichever process next touches the database.
func (a *app) openForks(ctx context.Context) (forks.Service, error) {
	if a.forks != nil {
		return a.forks, nil
	}
	db, err := forks.OpenDB(a.forksDBPath(), time.Second)
	if err != nil {
		return nil, err
	}
	if gone, err := db.Sweep(time.Now()); err != nil {
		log.G(ctx).WithError(err).Warn("sweeping expired forks failed")
	} else if len(gone) > 0 {
		log.G(ctx).WithField("forks", gone).Info("removed expired forks")
	}
	a.forks = db
	a.closers = append(a.closers, db.Close)
	return db, nil
}

// resolve turns a ROOT|FORK argument into a root (and the fork, if it named one).
func (a *app) resolve(ctx context.Context, ref string) (forks.Target, error) {
	if casstore.LooksLikeHash(ref) {
		return forks.Resolve(ctx, nil, ref)
	}
	svc, err := a.openForks(ctx)
	if err != nil {
		return forks.Target{}, err
	}
	return forks.Resolve(ctx, svc, ref)
}

func (a *app) close() error {
	var first error
	for i := len(a.closers) - 1; i >= 0; i-- {
		if err := a.closers[i](); err != nil && first == nil {
			first = err
		}
	}
	a.closers = nil
	return first
}

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/log"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/internal/arrivalspool"
	"github.com/tidepool-dev/tidepool/internal/runcmd"
	"github.com/tidepool-dev/tidepool/localapi"
)

// DefaultRoot is where tidepool and tidepoold keep their state unless told otherwise.
const DefaultRoot = "/var/lib/tidepool"

// app holds the global flags and lazily opened resources shared by the commands.
type app struct {
	root     string
	storeDir string
	logLevel string

	apiAddress string
	limits     casstore.Limits
	remote     remoteFlags

	store   *casstore.Store
	forks   forks.Service
	db      *forks.DB        // set when the database is opened directly
	api     *localapi.Client // set when tidepoold owns the database
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
	f.StringVar(&a.apiAddress, "api-address", "", "tidepoold API socket (default: the one recorded in ROOT/tidepoold.json while a daemon runs)")
	d := casstore.DefaultLimits()
	f.Int64Var(&a.limits.MaxEntries, "max-tree-entries", d.MaxEntries, "refuse to walk a tree that expands to more entries (paths) than this")
	f.IntVar(&a.limits.MaxDepth, "max-tree-depth", d.MaxDepth, "refuse to walk a tree nested deeper than this")
	f.Int64Var(&a.limits.MaxBytes, "max-tree-bytes", d.MaxBytes, "refuse to check out a tree holding more bytes of file content than this")
	a.remote.register(f)
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

// openForks returns the fork service: tidepoold's API when a daemon owns this root
// (it holds the database open), else the database itself. Expired forks are swept on
// the way, so a TTL is enforced by whichever process next touches the database.
func (a *app) openForks(ctx context.Context) (forks.Service, error) {
	if a.forks != nil {
		return a.forks, nil
	}
	if c, err := a.runningDaemon(ctx); err != nil {
		return nil, err
	} else if c != nil {
		a.forks = c
		return c, nil
	}
	db, err := forks.OpenDB(a.forksDBPath(), time.Second)
	if err != nil {
		if errors.Is(err, forks.ErrLocked) {
			return nil, fmt.Errorf("%w, and no tidepoold answers for root %s", err, a.root)
		}
		return nil, err
	}
	db.SetGuard(storeGuard{a})
	if gone, err := db.Sweep(time.Now()); err != nil {
		log.G(ctx).WithError(err).Warn("sweeping expired forks failed")
	} else if len(gone) > 0 {
		log.G(ctx).WithField("forks", gone).Info("removed expired forks")
	}
	a.forks, a.db = db, db
	a.closers = append(a.closers, db.Close)
	return db, nil
}

// storeGuard opens the store only when a record that names a root is written, so
// commands that only read fork records do not create a store.
type storeGuard struct{ a *app }

func (g storeGuard) Hold() (func(), error) {
	s, err := g.a.openStore()
	if err != nil {
		return nil, err
	}
	return s.Hold()
}

func (g storeGuard) Has(h casstore.Hash) (bool, error) {
	s, err := g.a.openStore()
	if err != nil {
		return false, err
	}
	return s.Has(h)
}

// announce tells the tidepoold owning this root, if one runs and keeps its objects in
// the store this command wrote to, of a root the command put there, so that it
// prepares the root's views in the background (Daemon.RootArrived). The root is
// recorded in the arrival spool first and the record dropped once a daemon was told:
// a daemon that is not running, or cannot be told, prepares the root when it next
// starts (see package arrivalspool). The command's work is done either way: what
// fails here is only logged.
func (a *app) announce(ctx context.Context, root casstore.Hash) {
	recorded := a.spoolRoot(ctx, root)
	c, err := a.runningDaemon(ctx)
	if err != nil || c == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	info, err := c.Info(ctx)
	if err == nil && !sameDir(info.GetStore(), a.storePath()) {
		return // another store: the daemon has none of the root's objects
	}
	if err == nil {
		err = c.RootArrived(ctx, root)
	}
	if err != nil {
		log.G(ctx).WithError(err).Debug("tidepoold not told of the root; its next start prepares its views")
		return
	}
	if recorded {
		if err := arrivalspool.Remove(a.root, root); err != nil {
			log.G(ctx).WithError(err).Debug("arrival record of a root tidepoold was told of not removed")
		}
	}
}

// forkMovedTo records root, which this command made or moved a fork to, for the next
// tidepoold start if it did so on the fork database itself (no tidepoold ran); through
// tidepoold's API, the daemon was told by the call.
func (a *app) forkMovedTo(ctx context.Context, root casstore.Hash) {
	if a.db != nil && root != casstore.EmptyHash {
		a.spoolRoot(ctx, root)
	}
}

// spoolRoot records a root this command put in the store in the arrival spool, for
// the next tidepoold start; it reports whether it did.
func (a *app) spoolRoot(ctx context.Context, root casstore.Hash) bool {
	if err := arrivalspool.Add(a.root, a.storePath(), root); err != nil {
		log.G(ctx).WithError(err).Debug("root not recorded for the next tidepoold start")
		return false
	}
	return true
}

// sameDir reports whether two paths name one directory.
func sameDir(a, b string) bool {
	x, errA := os.Stat(a)
	y, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(x, y)
}

// daemonAddress is the API socket of the tidepoold that owns this root: --api-address,
// or the one its state file records while it runs; "" when none runs.
func (a *app) daemonAddress() string {
	if a.apiAddress != "" {
		return a.apiAddress
	}
	return runcmd.APIAddress(a.root)
}

// runningDaemon is a client of the tidepoold that owns this root, connected once per
// invocation (dialDaemon); nil (and no error) when none runs.
func (a *app) runningDaemon(ctx context.Context) (*localapi.Client, error) {
	if a.api != nil {
		return a.api, nil
	}
	c, err := a.dialDaemon(ctx)
	if err != nil || c == nil {
		return nil, err
	}
	a.api = c
	a.closers = append(a.closers, c.Close)
	return c, nil
}

// dialDaemon connects to the tidepoold that owns this root, if one runs. It returns
// nil (and no error) when none does.
func (a *app) dialDaemon(ctx context.Context) (*localapi.Client, error) {
	addr := a.daemonAddress()
	if addr == "" {
		return nil, nil
	}
	c, err := localapi.Dial(ctx, addr, 3*time.Second)
	if err != nil {
		if a.apiAddress != "" {
			return nil, err
		}
		log.G(ctx).WithError(err).Warn("tidepoold state file found but its API does not answer; opening the database directly")
		return nil, nil
	}
	return c, nil
}

// daemon returns a client of the tidepoold owning this root; commands that only a
// daemon can serve (pools) use it. With nothing to fall back to, it makes no round
// trip: the command's first call connects, and says so if no daemon answers.
func (a *app) daemon(ctx context.Context) (*localapi.Client, error) {
	if a.api != nil {
		return a.api, nil
	}
	addr := a.daemonAddress()
	if addr == "" {
		return nil, fmt.Errorf("no tidepoold runs for root %s (or pass --api-address)", a.root)
	}
	c, err := localapi.Connect(addr)
	if err != nil {
		return nil, err
	}
	a.api = c
	a.closers = append(a.closers, c.Close)
	return c, nil
}

// liveRoots lists the roots garbage collection must keep, from whoever owns the
// fork database.
func (a *app) liveRoots(ctx context.Context) ([]casstore.Hash, error) {
	if _, err := a.openForks(ctx); err != nil {
		return nil, err
	}
	if a.api != nil {
		return a.api.LiveRoots(ctx)
	}
	return a.db.LiveRoots()
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

// target resolves a ROOT|FORK argument and then opens the store, the two steps every
// command that reads a tree starts with (in this order, so a bad argument is reported
// before a missing store).
func (a *app) target(ctx context.Context, ref string) (*casstore.Store, forks.Target, error) {
	t, err := a.resolve(ctx, ref)
	if err != nil {
		return nil, forks.Target{}, err
	}
	s, err := a.openStore()
	if err != nil {
		return nil, forks.Target{}, err
	}
	return s, t, nil
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

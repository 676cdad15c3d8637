package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/fuse"
	"github.com/tidepool-dev/tidepool/hostcheck"
	"github.com/tidepool-dev/tidepool/kview"
)

func init() { commands = append(commands, newMountCommand, newUmountCommand) }

// readyEnv tells a re-executed `mount --daemon` child which fd to report readiness
// on: "ok\n" once the view is mounted, or the error that stopped it.
const readyEnv = "TIDEPOOL_MOUNT_READY_FD"

// daemonReadyTimeout bounds how long `mount --daemon` waits for its child.
const daemonReadyTimeout = time.Minute

type mountFlags struct {
	mode          string
	prefix        string
	owner         string
	noPassthrough bool
	noOpen        bool
	allowOther    bool
	daemon        bool
	logFile       string
}

func newMountCommand(a *app) *cobra.Command {
	var f mountFlags
	cmd := &cobra.Command{
		Use:   "mount [flags] ROOT|FORK DIR",
		Short: "Mount a read-only view of a root or fork",
		Long: `Mount a read-only view of ROOT (or FORK's current root) at DIR.

--mode kernel mounts a kernel view: a metadata-only EROFS image of the tree (cached
under ROOT/kview) with the object store as an overlayfs data-only layer. The kernel
serves it alone, so the command returns at once and the view stays until
tidepool umount DIR. It needs kernel >= 6.12, root, and every object of the tree in
the local store. --mode fuse serves a FUSE view from this process: nothing is read
up front, directories are decoded when first looked up and files opened from the
verified store objects (with FUSE passthrough when the kernel offers it). --mode auto
(the default) mounts a kernel view when it can, FUSE otherwise; the FUSE-only flags
(--daemon, --log-file, --no-open, --no-passthrough) choose FUSE.

--prefix places the tree under a relative path inside DIR (parents are synthesized,
owned by 0:0), so DIR can serve as an overlay lower that merges with an image's own
directory there. --owner sets the uid:gid reported for the tree (default 0:0).

Only the mounting user (and overlays it mounts) can reach the view unless
--allow-other is given; then the kernel enforces the owner and modes the view
reports (default_permissions).

A FUSE view is served in the foreground until SIGINT/SIGTERM or until DIR is unmounted
(tidepool umount DIR). With --daemon it serves from a detached background process
and prints that process's pid once the view is mounted. A fork is resolved once, at
mount: later commits to it are not seen by this view.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runMount(cmd.Context(), a, f, args[0], args[1], cmd.OutOrStdout())
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.mode, "mode", "auto", "auto, kernel or fuse (see above)")
	fl.StringVar(&f.prefix, "prefix", "", "place the tree under this relative path inside DIR (e.g. app)")
	fl.StringVar(&f.owner, "owner", "0:0", "numeric UID:GID that owns the tree's files and directories")
	fl.BoolVar(&f.noPassthrough, "no-passthrough", false, "serve reads through this process even if the kernel supports FUSE passthrough")
	fl.BoolVar(&f.allowOther, "allow-other", false, "let other users read the view (the kernel enforces the --owner and modes reported); by default only the mounting user and overlays it mounts reach it")
	fl.BoolVar(&f.noOpen, "no-open", false, "kernel open caching: no round trip per open, no passthrough, a page cache of the view's own")
	fl.BoolVar(&f.daemon, "daemon", false, "serve from a detached background process; print its pid once mounted")
	fl.StringVar(&f.logFile, "log-file", "", "with --daemon, append the background process's logs to this file (default: discard)")
	return cmd
}

func newUmountCommand(a *app) *cobra.Command {
	var lazy bool
	cmd := &cobra.Command{
		Use:   "umount [--lazy] DIR",
		Short: "Unmount a view mounted by tidepool mount",
		Long: `Unmount the tidepool view at DIR; the process serving a FUSE view then exits. A view in use
(an open file, an overlay on top) is not unmounted unless --lazy is given, which
detaches it at once and lets it go when its last user does; --lazy also clears a
view whose serving process died. DIR must hold a tidepool view.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if kview.IsMounted(args[0]) {
				return umountKernel(cmd.Context(), a, args[0], lazy)
			}
			if lazy {
				return fuse.UnmountStale(args[0])
			}
			err := fuse.UnmountDir(args[0])
			if errors.Is(err, errdefs.ErrFailedPrecondition) {
				return fmt.Errorf("%w (still in use: stop its users, or use --lazy)", err)
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&lazy, "lazy", false, "detach now even if busy (or if its server died)")
	return cmd
}

// parseOwner reads a strict numeric "UID:GID".
func parseOwner(s string) (uid, gid uint32, err error) {
	bad := func() (uint32, uint32, error) {
		return 0, 0, fmt.Errorf("invalid --owner %q: want numeric UID:GID such as 1000:1000: %w", s, errdefs.ErrInvalidArgument)
	}
	u, g, ok := strings.Cut(s, ":")
	if !ok {
		return bad()
	}
	ids := [2]uint32{}
	for i, part := range []string{u, g} {
		if part == "" || strings.TrimLeft(part, "0123456789") != "" {
			return bad()
		}
		n, err := strconv.ParseUint(part, 10, 32)
		if err != nil || n == 1<<32-1 { // -1 means "unchanged" to the kernel
			return bad()
		}
		ids[i] = uint32(n)
	}
	return ids[0], ids[1], nil
}

func runMount(ctx context.Context, a *app, f mountFlags, ref, dir string, stdout io.Writer) (err error) {
	uid, gid, err := parseOwner(f.owner)
	if err != nil {
		return err
	}
	if err := fuse.ValidatePrefix(f.prefix); err != nil {
		return err
	}
	fuseOnly := f.noPassthrough || f.noOpen || f.daemon || f.logFile != ""
	switch f.mode {
	case "auto":
		if !fuseOnly && os.Getenv(readyEnv) == "" {
			done, err := mountKernel(ctx, a, f, ref, dir, uid, gid)
			if done || err != nil {
				return err
			}
		}
	case "kernel":
		if fuseOnly {
			return fmt.Errorf("--daemon, --log-file, --no-open and --no-passthrough apply to FUSE views, not to --mode kernel: %w", errdefs.ErrInvalidArgument)
		}
		_, err := mountKernel(ctx, a, f, ref, dir, uid, gid)
		return err
	case "fuse":
	default:
		return fmt.Errorf("invalid --mode %q: want auto, kernel or fuse: %w", f.mode, errdefs.ErrInvalidArgument)
	}
	ready, err := readyPipe()
	if err != nil {
		return err
	}
	if ready == nil && f.daemon {
		return daemonize(ctx, f, dir, stdout)
	}
	if ready != nil {
		// Tell the waiting parent how this ended, if it ends before the view is up.
		defer func() {
			if ready != nil {
				fmt.Fprint(ready, err)
				ready.Close()
			}
		}()
	}

	t, err := a.resolve(ctx, ref)
	if err != nil {
		return err
	}
	// Release the fork database (or daemon connection) now: a mount runs for long.
	if err := a.close(); err != nil {
		return err
	}
	store, err := a.openStore()
	if err != nil {
		return err
	}
	v, err := fuse.Mount(ctx, store, t.Root, dir, fuse.Options{
		Prefix:             f.prefix,
		UID:                uid,
		GID:                gid,
		DisablePassthrough: f.noPassthrough,
		NoOpen:             f.noOpen,
		Private:            !f.allowOther,
		Limits:             a.limits,
	})
	if err != nil {
		return err
	}
	lg := log.G(ctx).WithFields(log.Fields{"dir": v.Dir(), "root": t.Root, "passthrough": v.PassthroughActive()})
	lg.Info("view mounted")
	if ready != nil {
		_, werr := io.WriteString(ready, "ok\n")
		ready.Close()
		ready = nil
		if werr != nil {
			lg.WithError(werr).Warn("parent went away before the view was ready")
		}
	}

	select {
	case <-v.Done():
		lg.Info("view unmounted externally")
		return nil
	case <-ctx.Done():
	}
	err = v.Unmount()
	if errors.Is(err, errdefs.ErrFailedPrecondition) {
		lg.WithError(err).Warn("view is busy: detaching it; serving until its last user leaves")
		if err := fuse.UnmountStale(v.Dir()); err != nil {
			return err
		}
		<-v.Done()
		return nil
	}
	if err == nil {
		lg.Info("view unmounted")
	}
	return err
}

// kviewDir holds the kernel views' image cache, shared with tidepoold.
func (a *app) kviewDir() string { return filepath.Join(a.root, "kview") }

// mountKernel mounts a kernel view of ref at dir. In auto mode, done is false (and
// err nil) when the view should be served with FUSE instead: the kernel cannot, or
// the tree's objects are not all local.
func mountKernel(ctx context.Context, a *app, f mountFlags, ref, dir string, uid, gid uint32) (done bool, err error) {
	lg := log.G(ctx).WithField("dir", dir)
	if err := hostcheck.KernelViews(ctx, a.kviewDir()); err != nil {
		if f.mode == "kernel" {
			return false, err
		}
		if errors.Is(err, hostcheck.ErrRootFull) {
			lg.WithError(err).Warn("no kernel view: serving with FUSE")
		} else {
			lg.WithError(err).Info("no kernel view: serving with FUSE")
		}
		return false, nil
	}
	t, err := a.resolve(ctx, ref)
	if err != nil {
		return false, err
	}
	store, err := a.openStore()
	if err != nil {
		return false, err
	}
	h, err := kview.NewHost(store, filepath.Join(a.kviewDir(), "images"))
	if err != nil {
		return false, err
	}
	err = h.Mount(ctx, dir, kview.Spec{Root: t.Root, Prefix: f.prefix, UID: uid, GID: gid})
	if err != nil && f.mode == "auto" {
		// As tidepoold does (plugin.ViewHost): objects not all local is what auto
		// is for; anything else (a full disk, a corrupt tree) is a fault to see.
		if errdefs.IsNotFound(err) {
			lg.WithError(err).Info("tree not entirely local: serving with FUSE")
		} else {
			lg.WithError(err).Warn("kernel view failed: serving with FUSE")
		}
		return false, nil
	}
	if err != nil {
		return false, err
	}
	lg.WithField("root", t.Root).Info("kernel view mounted")
	return true, nil
}

// kernelViewRoots lists the roots of the kernel views mounted from this root's image
// cache, which garbage collection must keep.
func kernelViewRoots(a *app) ([]casstore.Hash, error) {
	dir := filepath.Join(a.kviewDir(), "images")
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	store, err := a.openStore()
	if err != nil {
		return nil, err
	}
	c, err := kview.NewCache(dir, store, nil)
	if err != nil {
		return nil, err
	}
	return c.MountedRoots()
}

// umountKernel unmounts the kernel view at dir and collects images no view has used
// for kview.DefaultGrace.
func umountKernel(ctx context.Context, a *app, dir string, lazy bool) error {
	var err error
	if lazy {
		err = syscall.Unmount(dir, syscall.MNT_DETACH)
	} else {
		err = kview.UnmountDir(dir)
	}
	if err != nil {
		return err
	}
	store, err := a.openStore()
	if err != nil {
		return err
	}
	h, err := kview.NewHost(store, filepath.Join(a.kviewDir(), "images"))
	if err != nil {
		return err
	}
	_, err = h.Cache().Collect(ctx, kview.DefaultGrace)
	return err
}

// readyPipe returns the readiness fd if this process is a `mount --daemon` child.
func readyPipe() (*os.File, error) {
	s := os.Getenv(readyEnv)
	if s == "" {
		return nil, nil
	}
	os.Unsetenv(readyEnv)
	fd, err := strconv.Atoi(s)
	if err != nil || fd < 3 {
		return nil, fmt.Errorf("invalid %s=%q", readyEnv, s)
	}
	return os.NewFile(uintptr(fd), "ready"), nil
}

// daemonize re-executes this command detached (new session, stdio on /dev/null or
// the log file), waits until the child reports the view mounted, prints the child's
// pid and returns. If the child fails first, its error is returned and nothing is
// left mounted.
func daemonize(ctx context.Context, f mountFlags, dir string, stdout io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("mount --daemon: %w", err)
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("mount --daemon: %w", err)
	}
	defer devnull.Close()
	logOut := devnull
	if f.logFile != "" {
		lf, err := os.OpenFile(f.logFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return fmt.Errorf("mount --daemon: log file: %w", err)
		}
		defer lf.Close()
		logOut = lf
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("mount --daemon: %w", err)
	}
	defer r.Close()
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), readyEnv+"=3")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, devnull, logOut
	cmd.ExtraFiles = []*os.File{w}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	w.Close()
	if err != nil {
		return fmt.Errorf("mount --daemon: start: %w", err)
	}

	_ = r.SetReadDeadline(time.Now().Add(daemonReadyTimeout))
	stop := context.AfterFunc(ctx, func() { _ = r.SetReadDeadline(time.Now()) })
	msg, rerr := io.ReadAll(r)
	stop()
	if string(msg) == "ok\n" {
		pid := cmd.Process.Pid
		_ = cmd.Process.Release()
		fmt.Fprintln(stdout, pid)
		return nil
	}
	if rerr != nil { // timed out or interrupted: leave neither child nor mount behind
		_ = cmd.Process.Kill()
		defer func() { _ = fuse.UnmountStale(dir) }()
	}
	werr := cmd.Wait()
	switch {
	case len(msg) > 0:
		return errors.New(strings.TrimSpace(string(msg)))
	case rerr != nil:
		return fmt.Errorf("mount --daemon: no answer from the background process: %w", rerr)
	default:
		return fmt.Errorf("mount --daemon: background process exited before mounting: %v", werr)
	}
}

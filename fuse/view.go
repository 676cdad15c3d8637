package fuse

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	stdlog "log"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	gofs "github.com/hanwen/go-fuse/v2/fs"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
)

// FsName is both the FUSE source name and the subtype of every view mount, so views
// show up in /proc/self/mountinfo as fstype "fuse.tidepool" and a daemon can find
// (and clean up) the ones a crashed predecessor left.
const FsName = "tidepool"

// FsType is the fstype field of a view in /proc/self/mountinfo.
const FsType = "fuse." + FsName

const (
	// maxRequest is the largest READ the kernel sends when passthrough is off (go-fuse
	// uses it as max_read and max_write) and the readahead asked for: 128 KiB, the most
	// the kernel grants a FUSE mount's readahead, so larger requests would not be sent
	// for sequential reads anyway. Each reader goroutine of each view holds a buffer of
	// this size, which matters with hundreds of pooled views.
	maxRequest = 128 << 10
	// maxBackground lets the kernel keep many readahead READs in flight at once.
	maxBackground = 64
	// maxLinkTarget bounds the blob read as a symlink target (PATH_MAX).
	maxLinkTarget = 4096
)

// View is one read-only FUSE mount of a source tree: a root hash placed under a
// prefix, served lazily from a casstore.Store. A view knows nothing about who hosts
// it (the gRPC daemon today, a longer-lived serving process later): it needs a store,
// a directory and options.
type View struct {
	store  *casstore.Store
	dir    string
	opts   Options
	comps  []string // prefix components
	ctx    context.Context
	stats  *Stats
	inos   *inoTable
	state  atomic.Pointer[bindState]
	mtime  time.Time
	server *gofuse.Server
	top    *dirNode // the view root

	passthrough atomic.Bool
	noOpen      atomic.Bool // the kernel is told to open files without asking
	done        chan struct{}
	unmountMu   sync.Mutex

	openMu sync.Mutex
	open   map[*fileNode]struct{} // files holding a cached object file; nil once stopped
}

// bindState is swapped atomically, so that "a lookup saw the view unbound" (taint)
// and "the view got bound" are ordered: once Bind returns, Tainted is final.
type bindState struct {
	root    casstore.Hash
	tainted bool
}

// Mount mounts a view of root at dir and serves it until Unmount (or until someone
// unmounts dir). A zero root mounts the view unbound: its root directory is empty
// until Bind. Nothing of the tree is read here; only the existence of root is checked
// (locally, or at the source).
func Mount(ctx context.Context, store *casstore.Store, root casstore.Hash, dir string, opts Options) (*View, error) {
	if store == nil {
		return nil, fmt.Errorf("mount view: no store: %w", errdefs.ErrInvalidArgument)
	}
	if err := ValidatePrefix(opts.Prefix); err != nil {
		return nil, err
	}
	// The canonical path is what the mount table will show (see Mounts).
	abs, err := filepath.Abs(dir)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		return nil, fmt.Errorf("mount view at %s: %w", dir, err)
	}
	if st, err := os.Stat(abs); err != nil {
		return nil, fmt.Errorf("mount view at %s: %w", abs, err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("mount view at %s: not a directory: %w", abs, errdefs.ErrInvalidArgument)
	}
	if opts.EntryTimeout <= 0 {
		opts.EntryTimeout = DefaultTimeout
	}
	if opts.AttrTimeout <= 0 {
		opts.AttrTimeout = DefaultTimeout
	}
	v := &View{
		store: store,
		dir:   abs,
		opts:  opts,
		comps: splitPrefix(opts.Prefix),
		ctx:   log.WithLogger(context.WithoutCancel(ctx), log.G(ctx).WithField("view", abs)),
		stats: opts.Stats,
		inos:  newInoTable(),
		mtime: opts.Mtime,
		done:  make(chan struct{}),
		open:  map[*fileNode]struct{}{},
	}
	if v.stats == nil {
		v.stats = &Stats{}
	}
	if v.mtime.IsZero() {
		v.mtime = time.Now()
	}
	if !root.IsZero() {
		if err := v.checkRoot(ctx, root); err != nil {
			return nil, err
		}
	}
	v.state.Store(&bindState{root: root})

	neg := time.Duration(0)
	logger := stdlog.New(logWriter{ctx: v.ctx, debug: opts.Debug}, "", 0)
	fsopts := &gofs.Options{
		MountOptions: gofuse.MountOptions{
			AllowOther:       !opts.Private,
			FsName:           FsName,
			Name:             FsName,
			DirectMount:      true,
			DirectMountFlags: syscall.MS_RDONLY | syscall.MS_NOSUID | syscall.MS_NODEV,
			Options:          mountOptions(opts),
			MaxBackground:    maxBackground,
			MaxWrite:         maxRequest,
			MaxReadAhead:     maxRequest,
			DisableXAttrs:    true,
			Debug:            opts.Debug,
			Logger:           logger,
		},
		EntryTimeout:    &v.opts.EntryTimeout,
		AttrTimeout:     &v.opts.AttrTimeout,
		NegativeTimeout: &neg,
		RootStableAttr:  &gofs.StableAttr{Ino: rootIno, Mode: syscall.S_IFDIR},
		Logger:          logger,
	}
	rootNode := &dirNode{v: v, path: "", root: true, depth: -1}
	if len(v.comps) > 0 {
		rootNode.depth = 0
	}
	v.top = rootNode
	server, err := gofuse.NewServer(gofs.NewNodeFS(rootNode, fsopts), abs, &fsopts.MountOptions)
	if err != nil {
		return nil, fmt.Errorf("mount view at %s: %w", abs, err)
	}
	v.server = server
	go func() {
		server.Serve()
		v.closeAllOpen()
		close(v.done)
	}()
	if err := server.WaitMount(); err != nil {
		_ = server.Unmount()
		return nil, fmt.Errorf("mount view at %s: %w", abs, err)
	}
	// Opens the kernel sends before this point are served as usual, which is correct
	// in either mode: a file opened with a handle keeps it until its release.
	if opts.NoOpen {
		if server.KernelSettings().Flags64()&gofuse.CAP_NO_OPEN_SUPPORT != 0 {
			v.noOpen.Store(true)
		} else {
			log.G(v.ctx).Warn("kernel cannot open files without asking the server: serving opens")
		}
	}
	if !opts.DisablePassthrough && !v.noOpen.Load() {
		v.passthrough.Store(v.probePassthrough())
	}
	log.G(v.ctx).WithFields(log.Fields{
		"root": root, "prefix": opts.Prefix, "passthrough": v.passthrough.Load(), "noopen": v.noOpen.Load(),
	}).Debug("view mounted")
	return v, nil
}

// mountOptions are the FUSE mount options beyond go-fuse's own. A view that other
// users may reach has the kernel check the modes it reports (default_permissions):
// without it, the FUSE server would be asked to check, and go-fuse does not.
func mountOptions(opts Options) []string {
	if opts.Private {
		return []string{"ro"}
	}
	return []string{"ro", "default_permissions"}
}

// checkRoot fails early, with errdefs.ErrNotFound, for a root that is neither local
// nor at the source: a stat, not a read.
func (v *View) checkRoot(ctx context.Context, root casstore.Hash) error {
	if root == casstore.EmptyHash {
		return nil
	}
	ok, err := v.store.Has(root)
	if err != nil {
		return err
	}
	if ok {
		return nil
	}
	if v.opts.Source == nil {
		return fmt.Errorf("root %s is not in the store: %w", root, errdefs.ErrNotFound)
	}
	if _, err := v.opts.Source.Stat(ctx, root); err != nil {
		return fmt.Errorf("root %s is neither in the store nor at the source: %w", root, err)
	}
	return nil
}

// Bind makes an unbound view serve root (at its prefix) from now on. Binding a bound
// view is an error: overlayfs does not allow a lower layer to change under it.
func (v *View) Bind(root casstore.Hash) error {
	if root.IsZero() {
		return fmt.Errorf("bind view %s: zero root: %w", v.dir, errdefs.ErrInvalidArgument)
	}
	if err := v.checkRoot(v.ctx, root); err != nil {
		return fmt.Errorf("bind view %s: %w", v.dir, err)
	}
	for {
		s := v.state.Load()
		if !s.root.IsZero() {
			return fmt.Errorf("bind view %s: already bound to %s: %w", v.dir, s.root, errdefs.ErrFailedPrecondition)
		}
		if v.state.CompareAndSwap(s, &bindState{root: root, tainted: s.tainted}) {
			return nil
		}
	}
}

// bound returns the view's root, or false while it is unbound. With taint set, an
// unbound answer marks the view tainted (atomically with respect to Bind).
func (v *View) bound(taint bool) (casstore.Hash, bool) {
	for {
		s := v.state.Load()
		if !s.root.IsZero() {
			return s.root, true
		}
		if !taint || s.tainted {
			return casstore.Hash{}, false
		}
		if v.state.CompareAndSwap(s, &bindState{tainted: true}) {
			return casstore.Hash{}, false
		}
	}
}

// Tainted reports whether anything looked up the prefix's first component (or, with
// no prefix, anything at all at the root) or listed the root while the view was
// unbound. An overlay above such a view has cached what it saw, so the caller must
// discard it rather than bind and use it.
func (v *View) Tainted() bool { return v.state.Load().tainted }

// Root is the bound root, zero while unbound.
func (v *View) Root() casstore.Hash { return v.state.Load().root }

// Dir is the mountpoint.
func (v *View) Dir() string { return v.dir }

// Prefix is where the tree sits inside the view.
func (v *View) Prefix() string { return v.opts.Prefix }

// Stats returns the counters the view reports into.
func (v *View) Stats() *Stats { return v.stats }

// PassthroughActive reports whether opens are served with FUSE passthrough: the
// kernel offered it, it was not disabled, and registering a backing file from the
// store's filesystem worked.
func (v *View) PassthroughActive() bool { return v.passthrough.Load() }

// NoOpenActive reports whether the view runs with kernel open caching
// (Options.NoOpen, and the kernel supports it): files are opened without asking this
// process and read by offset through it.
func (v *View) NoOpenActive() bool { return v.noOpen.Load() }

// Done is closed when the FUSE server has exited: after Unmount, or after anyone
// unmounted the directory.
func (v *View) Done() <-chan struct{} { return v.done }

// Unmount unmounts the view and waits for its server to exit. If the mount is busy
// (an overlay still uses it, a process has a file open) it fails with an error
// wrapping errdefs.ErrFailedPrecondition and the view keeps serving. Unmounting a
// view someone else already unmounted succeeds.
func (v *View) Unmount() error {
	v.unmountMu.Lock()
	defer v.unmountMu.Unlock()
	select {
	case <-v.done:
		return nil
	default:
	}
	// unmount(2) takes whatever is mounted on top; never take someone else's mount.
	if top, err := topMount(v.dir); err == nil && top != "" && top != FsType {
		return fmt.Errorf("unmount view %s: %s is mounted over it: %w", v.dir, top, errdefs.ErrFailedPrecondition)
	}
	var err error
	for delay := 2 * time.Millisecond; ; delay *= 2 {
		err = unix.Unmount(v.dir, 0)
		if err != unix.EBUSY || delay > 200*time.Millisecond {
			break
		}
		// The kernel may still be releasing files closed a moment ago.
		time.Sleep(delay)
	}
	if errors.Is(err, unix.EPERM) {
		// Mounted through fusermount (not root): let it unmount.
		err = v.server.Unmount()
	}
	switch {
	case err == nil:
	case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT):
		// Not mounted any more: someone unmounted it under us.
		select {
		case <-v.done:
			return nil
		case <-time.After(5 * time.Second):
			return fmt.Errorf("unmount view %s: not mounted, but its server has not exited", v.dir)
		}
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("unmount view %s: %w: %w", v.dir, err, errdefs.ErrFailedPrecondition)
	default:
		return fmt.Errorf("unmount view %s: %w", v.dir, err)
	}
	<-v.done
	return nil
}

// probePassthrough registers a backing file from the store's filesystem with the
// kernel and releases it at once: that succeeds only if the kernel negotiated
// passthrough, we have the privilege, and the store is not too deeply stacked.
// Opens made before the probe returns are served by plain reads.
func (v *View) probePassthrough() bool {
	if v.server.KernelSettings().Flags64()&gofuse.CAP_PASSTHROUGH == 0 {
		return false
	}
	f, err := probeFile(v.store)
	if err != nil {
		log.G(v.ctx).WithError(err).Debug("passthrough probe: no file to register")
		return false
	}
	defer f.Close()
	id, errno := v.server.RegisterBackingFd(&gofuse.BackingMap{Fd: int32(f.Fd())})
	if errno != 0 {
		log.G(v.ctx).WithError(errno).Debug("passthrough unavailable: falling back to reads through the server")
		return false
	}
	if errno := v.server.UnregisterBackingFd(id); errno != 0 {
		log.G(v.ctx).WithError(errno).Warn("passthrough probe: release backing file")
	}
	return true
}

// probeFile opens a regular file on the store's filesystem: an anonymous temp file
// if the store is writable, else any existing object.
func probeFile(store *casstore.Store) (*os.File, error) {
	fd, err := unix.Open(store.Root(), unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err == nil {
		return os.NewFile(uintptr(fd), "passthrough-probe"), nil
	}
	var found string
	stop := errors.New("found")
	werr := store.Walk(func(_ casstore.Hash, p string) error {
		found = p
		return stop
	})
	if found == "" {
		if werr == nil {
			werr = fs.ErrNotExist
		}
		return nil, fmt.Errorf("store %s has no object to probe with: %w", store.Root(), werr)
	}
	return os.Open(found)
}

// logWriter sends go-fuse's own log lines (handler panics, write failures) to the
// containerd logger instead of stderr.
// With Options.Debug they are request traces, logged at debug level.
type logWriter struct {
	ctx   context.Context
	debug bool
}

func (w logWriter) Write(p []byte) (int, error) {
	e := log.G(w.ctx).WithField("component", "go-fuse")
	msg := strings.TrimRight(string(p), "\n")
	if w.debug {
		e.Debug(msg)
	} else {
		e.Warn(msg)
	}
	return len(p), nil
}

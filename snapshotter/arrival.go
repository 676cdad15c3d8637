package snapshotter

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"sync"

	"github.com/containerd/continuity"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
)

// Views of roots that arrive. A view's costly part is a kernel view's image: a scan of
// every tree object of the root, then the write. Paid when a container is created, it
// is most of what a fork's first container costs over one without a fork. containerd's
// EROFS snapshotter converts a layer when it is unpacked, not when it is first
// mounted; the snapshotter does likewise for the roots it learns of: a container's
// commit (its fork's next root, for that container's workdir and owner) and a fork
// made or moved through the local API (a pulled ref, a CLI commit: for the workdirs
// and owners views were lately mounted with, since a host's containers mostly share
// them). The images are built in the background, one at a time, so a host busy
// creating containers gives them at most one CPU; the container that next runs on the
// root finds its image cached, or joins the build under way (single-flight). The
// shapes of recent views are kept in ROOT/view-shapes.json (rewritten when a shape
// not among them appears), so a root that arrives right after a restart is prepared
// too; a missing or unreadable file only means no shapes yet. Before any of that, the
// worker has the view host warm up (a kernel host decodes the trees of the roots its
// images showed last), so that the first images built after a restart cost what later
// ones do.

const (
	// recentViewShapes is how many distinct (workdir, owner) pairs of recent views a
	// root that arrives is prepared for.
	recentViewShapes = 4
	// arrivalQueue bounds the views waiting to be prepared; more are dropped (their
	// first container builds them, as without preparation).
	arrivalQueue = 64
)

// viewShape is where and for whom a view shows its tree; the JSON of the recent ones
// is ROOT/view-shapes.json.
type viewShape struct {
	Prefix string `json:"prefix"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
}

func shapeOf(spec ViewSpec) viewShape { return viewShape{spec.Prefix, spec.UID, spec.GID} }

// arrivals prepares the views of roots that arrive, in one background worker, which
// also saves the recent shapes (off the create path that records them).
type arrivals struct {
	views  ViewHost
	m      *Metrics
	queue  chan ViewSpec
	save   chan struct{} // a nudge to the worker: recent changed
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	recent []viewShape // most recent first
	dirty  bool        // recent has a shape the file lacks
	saved  string      // where recent is kept ("": nowhere)
}

func newArrivals(ctx context.Context, views ViewHost, m *Metrics, saved string) *arrivals {
	ctx, cancel := context.WithCancel(log.WithLogger(context.WithoutCancel(ctx), log.G(ctx).WithField("component", "view-arrivals")))
	a := &arrivals{views: views, m: m, queue: make(chan ViewSpec, arrivalQueue), save: make(chan struct{}, 1),
		ctx: ctx, cancel: cancel, done: make(chan struct{}), saved: saved}
	a.load()
	go a.run()
	return a
}

// load reads the shapes saved by an earlier run; a shape whose workdir is not one a
// label could give is skipped.
func (a *arrivals) load() {
	if a.saved == "" {
		return
	}
	b, err := os.ReadFile(a.saved)
	var shapes []viewShape
	if err == nil {
		err = json.Unmarshal(b, &shapes)
	}
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			log.G(a.ctx).WithError(err).WithField("path", a.saved).Warn("recent view shapes unreadable; starting without them")
		}
		return
	}
	for _, sh := range shapes {
		if wd, err := binding.ParseWorkdir("/" + sh.Prefix); err != nil || wd[1:] != sh.Prefix {
			log.G(a.ctx).WithField("path", a.saved).WithField("prefix", sh.Prefix).Warn("skipping a saved view shape with an invalid workdir")
			continue
		}
		if len(a.recent) < recentViewShapes {
			a.recent = append(a.recent, sh)
		}
	}
}

// saveRecent writes the recent shapes if the file lacks one (losing them loses only
// preparation, so a failure is logged).
func (a *arrivals) saveRecent() {
	a.mu.Lock()
	if !a.dirty || a.saved == "" {
		a.mu.Unlock()
		return
	}
	b, _ := json.Marshal(a.recent)
	a.dirty = false
	a.mu.Unlock()
	if err := continuity.AtomicWriteFile(a.saved, b, 0o600); err != nil {
		log.G(a.ctx).WithError(err).WithField("path", a.saved).Warn("could not save recent view shapes")
	}
}

func (a *arrivals) run() {
	defer close(a.done)
	// First what an earlier process left (the trees of recent views): the roots
	// that arrive meanwhile wait in the queue, and their builds then find the trees
	// they share with those decoded.
	if err := a.views.WarmUp(a.ctx); err != nil && a.ctx.Err() == nil {
		log.G(a.ctx).WithError(err).Debug("views not warmed up")
	}
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-a.save:
			a.saveRecent()
		case spec := <-a.queue:
			err := a.views.Prebuild(a.ctx, spec)
			if err != nil && a.ctx.Err() == nil {
				log.G(a.ctx).WithError(err).WithField("root", spec.Root.Short()).WithField("prefix", spec.Prefix).Debug("view of an arrived root not prepared")
			}
			if err == nil {
				a.m.viewsPrepared.Inc()
			}
			a.m.viewsPending.Dec()
		}
	}
}

// seen records the shape of a view a container was given.
func (a *arrivals) seen(spec ViewSpec) {
	sh := shapeOf(spec)
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, r := range a.recent {
		if r == sh {
			copy(a.recent[1:i+1], a.recent[:i])
			a.recent[0] = sh
			return
		}
	}
	if len(a.recent) < recentViewShapes {
		a.recent = append(a.recent, viewShape{})
	}
	copy(a.recent[1:], a.recent)
	a.recent[0] = sh
	a.dirty = true
	select {
	case a.save <- struct{}{}:
	default: // a save is already due
	}
}

// committed prepares spec, the view of a container's commit as that container saw
// its tree.
func (a *arrivals) committed(spec ViewSpec) {
	a.seen(spec)
	if !spec.Root.IsZero() {
		a.m.rootsArrived.WithLabelValues(arrivedViaCommit).Inc()
	}
	a.enqueue(spec)
}

// How a root arrived (the via label of tidepool_snapshotter_roots_arrived_total).
const (
	arrivedViaCommit = "commit" // a container's commit
	arrivedViaAPI    = "api"    // a fork made or moved through the API, a command's root
	arrivedViaSpool  = "spool"  // a command's root recorded while no tidepoold ran
)

// arrived prepares views of root in the shapes of recent views.
func (a *arrivals) arrived(root casstore.Hash, via string) {
	if root.IsZero() {
		return
	}
	a.m.rootsArrived.WithLabelValues(via).Inc()
	a.mu.Lock()
	shapes := append([]viewShape(nil), a.recent...)
	a.mu.Unlock()
	for _, sh := range shapes {
		a.enqueue(ViewSpec{Root: root, Prefix: sh.Prefix, UID: sh.UID, GID: sh.GID})
	}
}

func (a *arrivals) enqueue(spec ViewSpec) {
	if spec.Root.IsZero() {
		return
	}
	a.m.viewsPending.Inc()
	select {
	case a.queue <- spec:
	default:
		a.m.viewsPending.Dec()
		log.G(a.ctx).WithField("root", spec.Root.Short()).Debug("view preparation queue full; the root's first container builds its view")
	}
}

// close stops the worker (a build under way is cancelled; the image cache keeps
// nothing of it) and saves the recent shapes if a save was still due.
func (a *arrivals) close() {
	a.cancel()
	<-a.done
	a.saveRecent()
}

// RootArrived tells the snapshotter of a root that became a fork's (a fork made or
// moved other than by a container's commit), so that it prepares its views in the
// background for the workdirs and owners of recent views.
func (s *Snapshotter) RootArrived(root casstore.Hash) { s.arrivals.arrived(root, arrivedViaAPI) }

// RootsRecorded tells the snapshotter of roots a command put in the store while no
// tidepoold ran (package arrivalspool), newest first: they are prepared as roots
// that arrive are, once the start-up warm-up is done.
func (s *Snapshotter) RootsRecorded(roots []casstore.Hash) {
	for _, r := range roots {
		s.arrivals.arrived(r, arrivedViaSpool)
	}
}

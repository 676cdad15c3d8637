package snapshotter

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"sync"

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
// too; a missing or unreadable file only means no shapes yet.

const (
	// recentViewShapes is how many distinct (workdir, owner) pairs of recent views a
	// root that arrives is prepared for.
	recentViewShapes = 4
	// arrivalQueue bounds the views waiting to be prepared; more are dropped (their
	// first container builds them, as without preparation).
	arrivalQueue = 64
)

// viewShape is where and for whom a view shows its tree.
type viewShape struct {
	prefix   string
	uid, gid uint32
}

// savedShape is a viewShape in ROOT/view-shapes.json.
type savedShape struct {
	Prefix string `json:"prefix"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
}

// arrivals prepares the views of roots that arrive, in one background worker.
type arrivals struct {
	views  ViewHost
	queue  chan ViewSpec
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	recent []viewShape // most recent first
	saved  string      // where recent is kept ("": nowhere)
}

func newArrivals(ctx context.Context, views ViewHost, saved string) *arrivals {
	ctx, cancel := context.WithCancel(log.WithLogger(context.WithoutCancel(ctx), log.G(ctx).WithField("component", "view-arrivals")))
	a := &arrivals{views: views, queue: make(chan ViewSpec, arrivalQueue), ctx: ctx, cancel: cancel, done: make(chan struct{}), saved: saved}
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
	var shapes []savedShape
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
			a.recent = append(a.recent, viewShape{sh.Prefix, sh.UID, sh.GID})
		}
	}
}

// save writes the recent shapes (temp file and rename; not synced: losing them
// loses only preparation). The caller holds a.mu.
func (a *arrivals) save() {
	if a.saved == "" {
		return
	}
	shapes := make([]savedShape, len(a.recent))
	for i, r := range a.recent {
		shapes[i] = savedShape{r.prefix, r.uid, r.gid}
	}
	b, _ := json.Marshal(shapes)
	tmp := a.saved + ".tmp"
	err := os.WriteFile(tmp, b, 0o600)
	if err == nil {
		err = os.Rename(tmp, a.saved)
	}
	if err != nil {
		os.Remove(tmp)
		log.G(a.ctx).WithError(err).WithField("path", a.saved).Warn("could not save recent view shapes")
	}
}

func (a *arrivals) run() {
	defer close(a.done)
	for {
		select {
		case <-a.ctx.Done():
			return
		case spec := <-a.queue:
			if err := a.views.Prebuild(a.ctx, spec); err != nil && a.ctx.Err() == nil {
				log.G(a.ctx).WithError(err).WithField("root", spec.Root.Short()).WithField("prefix", spec.Prefix).Debug("view of an arrived root not prepared")
			}
		}
	}
}

// seen records the shape of a view a container was given.
func (a *arrivals) seen(spec ViewSpec) {
	sh := viewShape{spec.Prefix, spec.UID, spec.GID}
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
	a.save()
}

// committed prepares the view of root, a container's commit, as that container saw
// its tree.
func (a *arrivals) committed(root casstore.Hash, spec ViewSpec) {
	a.seen(spec)
	spec.Root, spec.Image = root, false
	a.enqueue(spec)
}

// arrived prepares views of root in the shapes of recent views.
func (a *arrivals) arrived(root casstore.Hash) {
	a.mu.Lock()
	shapes := append([]viewShape(nil), a.recent...)
	a.mu.Unlock()
	for _, sh := range shapes {
		a.enqueue(ViewSpec{Root: root, Prefix: sh.prefix, UID: sh.uid, GID: sh.gid})
	}
}

func (a *arrivals) enqueue(spec ViewSpec) {
	if spec.Root.IsZero() {
		return
	}
	select {
	case a.queue <- spec:
	default:
		log.G(a.ctx).WithField("root", spec.Root.Short()).Debug("view preparation queue full; the root's first container builds its view")
	}
}

// close stops the worker; a build under way is cancelled (the image cache keeps
// nothing of it).
func (a *arrivals) close() {
	a.cancel()
	<-a.done
}

// RootArrived tells the snapshotter of a root that became a fork's (a fork made or
// moved other than by a container's commit), so that it prepares its views in the
// background for the workdirs and owners of recent views.
func (s *Snapshotter) RootArrived(root casstore.Hash) { s.arrivals.arrived(root) }

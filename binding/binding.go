// Package binding defines how a container asks for a source fork, and checks the
// request. Two entrances meet here: snapshot labels at Prepare (ctr
// --snapshotter-label) and OCI annotations read by the runtime shim (nerdctl, CRI,
// which cannot set snapshot labels). Both give the same Spec and the same errors, each
// naming the key that was wrong.
package binding

import (
	"fmt"
	"path"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// Snapshot labels. containerd forwards only labels under "containerd.io/snapshot/" to a
// snapshotter, hence the prefix.
const (
	LabelPrefix  = "containerd.io/snapshot/tidepool."
	LabelFork    = LabelPrefix + "fork"    // root hash or fork id (or unique label)
	LabelWorkdir = LabelPrefix + "workdir" // absolute path in the rootfs, default /workspace
	LabelOwner   = LabelPrefix + "owner"   // uid:gid of the fork's files, default 0:0
	LabelDiscard = LabelPrefix + "discard" // "true": do not commit changes on remove
	// LabelLateBind prepares the snapshot with an empty fork view whose tree is bound
	// later (warm pools): the view exists in the overlay before the fork is known.
	LabelLateBind = LabelPrefix + "latebind"
	// LabelSlot, with LabelLateBind, prepares the snapshot with no view in its rootfs
	// but a slot: a host directory, shared for mount propagation, that the container
	// binds at the workdir (rslave) and onto which the bind mounts the fork's view,
	// writable, at claim (warm pools with kernel views).
	LabelSlot = LabelPrefix + "slot"
)

// OCI annotations, read by containerd-shim-tidepool-v1 at Create.
const (
	AnnotationPrefix  = "dev.tidepool."
	AnnotationFork    = AnnotationPrefix + "fork"
	AnnotationWorkdir = AnnotationPrefix + "workdir"
	AnnotationOwner   = AnnotationPrefix + "owner"
	AnnotationDiscard = AnnotationPrefix + "discard"
	// AnnotationRuntime selects the shim's route (runc, runsc, a delegate shim).
	AnnotationRuntime = AnnotationPrefix + "runtime"
	// AnnotationPool asks for a warm member of the named tidepoold pool.
	AnnotationPool = AnnotationPrefix + "pool"
)

// RuntimeName is the runtime type containerd resolves to containerd-shim-tidepool-v1.
// The pools create their members with it; the shim registers under it.
const RuntimeName = "io.containerd.tidepool.v1"

// DoctorNamespace is the containerd namespace `tidepool doctor` creates for its
// transfer probe and deletes afterwards. It collects its own garbage, so tidepoold's
// snapshot gc watcher leaves it alone (a lease of the watcher's would create the
// namespace again right after the doctor deleted it).
const DoctorNamespace = "tidepool-doctor"

// DefaultWorkdir is where the fork appears when no workdir is given.
const DefaultWorkdir = "/workspace"

// Spec is a checked request to place a fork in a container's rootfs.
type Spec struct {
	Fork    string // as given: root hash, fork id or label; "" for a late-bound view
	Workdir string // absolute, clean
	UID     uint32
	GID     uint32
	Discard bool
	// LateBind prepares an empty view now; the fork is bound later.
	LateBind bool
	// Slot (with LateBind): the view is mounted at bind onto the snapshot's slot
	// instead of sitting in its rootfs (LabelSlot).
	Slot bool
}

// Prefix is the workdir relative to the rootfs, the path the fork view places its tree at.
func (s Spec) Prefix() string { return strings.TrimPrefix(s.Workdir, "/") }

// Owner renders uid:gid.
func (s Spec) Owner() string { return fmt.Sprintf("%d:%d", s.UID, s.GID) }

// Keys names the label or annotation keys a Spec is read from, so errors can name them.
type Keys struct {
	Fork, Workdir, Owner, Discard, LateBind, Slot string
}

// LabelKeys and AnnotationKeys are the two entrances.
var (
	LabelKeys      = Keys{Fork: LabelFork, Workdir: LabelWorkdir, Owner: LabelOwner, Discard: LabelDiscard, LateBind: LabelLateBind, Slot: LabelSlot}
	AnnotationKeys = Keys{Fork: AnnotationFork, Workdir: AnnotationWorkdir, Owner: AnnotationOwner, Discard: AnnotationDiscard}
)

// Defaults fill what a request leaves out.
type Defaults struct {
	Workdir  string
	UID, GID uint32
}

// Parse reads a Spec from labels or annotations. ok is false when the map asks for no
// fork at all. Every error wraps errdefs.ErrInvalidArgument and names the key.
func Parse(m map[string]string, keys Keys, def Defaults) (spec Spec, ok bool, err error) {
	fork, hasFork := m[keys.Fork]
	late := false
	if keys.LateBind != "" {
		if v, has := m[keys.LateBind]; has {
			if late, err = parseBool(keys.LateBind, v); err != nil {
				return Spec{}, false, err
			}
		}
	}
	slot := false
	if keys.Slot != "" {
		if v, has := m[keys.Slot]; has {
			if slot, err = parseBool(keys.Slot, v); err != nil {
				return Spec{}, false, err
			}
			if slot && !late {
				return Spec{}, false, invalid(keys.Slot, v, fmt.Sprintf("needs %s=true", keys.LateBind))
			}
		}
	}
	if !hasFork && !late {
		for _, k := range []string{keys.Workdir, keys.Owner, keys.Discard} {
			if _, has := m[k]; has && k != "" {
				return Spec{}, false, invalid(k, m[k], fmt.Sprintf("needs %s", keys.Fork))
			}
		}
		return Spec{}, false, nil
	}
	if hasFork && late {
		return Spec{}, false, invalid(keys.LateBind, m[keys.LateBind], fmt.Sprintf("cannot be combined with %s", keys.Fork))
	}
	spec = Spec{Fork: fork, LateBind: late, Slot: slot, UID: def.UID, GID: def.GID}
	if hasFork {
		if err := CheckForkRef(fork); err != nil {
			return Spec{}, false, invalid(keys.Fork, fork, err.Error())
		}
	}
	wd := def.Workdir
	if wd == "" {
		wd = DefaultWorkdir
	}
	if v, has := m[keys.Workdir]; has {
		wd = v
	}
	if spec.Workdir, err = ParseWorkdir(wd); err != nil {
		return Spec{}, false, invalid(keys.Workdir, wd, err.Error())
	}
	if v, has := m[keys.Owner]; has {
		if spec.UID, spec.GID, err = ParseOwner(v); err != nil {
			return Spec{}, false, invalid(keys.Owner, v, err.Error())
		}
	}
	if v, has := m[keys.Discard]; has {
		if spec.Discard, err = parseBool(keys.Discard, v); err != nil {
			return Spec{}, false, err
		}
	}
	return spec, true, nil
}

func invalid(key, value, why string) error {
	return fmt.Errorf("invalid %s=%q: %s: %w", key, value, why, errdefs.ErrInvalidArgument)
}

func parseBool(key, v string) (bool, error) {
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, invalid(key, v, "want true or false")
	}
	return b, nil
}

// CheckForkRef checks the shape of a fork reference without looking it up: a
// 64-character value must be a well-formed hash, anything else must be a plausible
// fork id or label.
func CheckForkRef(ref string) error {
	switch {
	case ref == "":
		return fmt.Errorf("empty fork")
	case casstore.LooksLikeHash(ref):
		_, err := casstore.ParseHash(ref)
		return err
	case len(ref) > 256:
		return fmt.Errorf("fork reference is %d bytes long", len(ref))
	case strings.ContainsAny(ref, "\x00\n"):
		return fmt.Errorf("fork reference contains a control character")
	}
	return nil
}

// ParseWorkdir accepts an absolute path inside the rootfs and returns it cleaned. It
// refuses relative paths, "..", the rootfs itself and names a tree could not hold, so
// the fork can never be placed outside the container's root.
func ParseWorkdir(wd string) (string, error) {
	if !strings.HasPrefix(wd, "/") {
		return "", fmt.Errorf("workdir must be an absolute path")
	}
	for _, part := range strings.Split(strings.Trim(wd, "/"), "/") {
		if part == ".." {
			return "", fmt.Errorf("workdir must not contain '..'")
		}
	}
	clean := path.Clean(wd)
	if clean == "/" {
		return "", fmt.Errorf("workdir cannot be the root of the container")
	}
	for _, part := range strings.Split(clean[1:], "/") {
		if err := casstore.CheckName(part); err != nil {
			return "", fmt.Errorf("workdir component: %w", err)
		}
	}
	if len(clean) > 1024 {
		return "", fmt.Errorf("workdir is longer than 1024 bytes")
	}
	return clean, nil
}

// ParseOwner parses "uid:gid" (decimal, each below 2^32-1).
func ParseOwner(s string) (uid, gid uint32, err error) {
	u, g, found := strings.Cut(s, ":")
	if !found {
		return 0, 0, fmt.Errorf("owner must be UID:GID")
	}
	pu, err := strconv.ParseUint(u, 10, 32)
	if err != nil || pu == 1<<32-1 {
		return 0, 0, fmt.Errorf("owner uid %q is not a number below 4294967295", u)
	}
	pg, err := strconv.ParseUint(g, 10, 32)
	if err != nil || pg == 1<<32-1 {
		return 0, 0, fmt.Errorf("owner gid %q is not a number below 4294967295", g)
	}
	return uint32(pu), uint32(pg), nil
}

package pool

import (
	"fmt"
	"hash/fnv"
	"path"
	"slices"
	"time"

	"github.com/containerd/containerd/v2/pkg/identifiers"

	"github.com/tidepool-dev/tidepool/binding"
)

// DefaultNamespaces are the containerd namespaces a pool serves when its
// configuration names none: ctr's and nerdctl's. CRI works in "k8s.io".
var DefaultNamespaces = []string{"default"}

// Template describes one pool. The plugin package maps its TOML onto it.
type Template struct {
	Name    string
	Image   string
	Runtime string // a runc-kind route of the tidepool shim: runc or runsc
	Workdir string // where claimed forks appear
	Owner   string // uid:gid of the fork's files
	CPUs    float64
	Memory  int64 // bytes; 0 = unlimited
	Min     int
	Target  int
	Max     int
	// RefillRate is how many members may be started per second.
	RefillRate float64
	MaxAge     time.Duration

	// Namespaces are the containerd namespaces the pool keeps members in
	// (DefaultNamespaces if none): a container adopts a member only in its own
	// namespace (see the package doc), and each namespace gets min, target and max
	// members of its own.
	Namespaces []string
	// ShimGroupSize is how many idle members share one shim process (about: members
	// are spread over ceil(Target/ShimGroupSize) groups by id); 1 gives every member
	// a shim of its own. 0 means DefaultShimGroupSize.
	ShimGroupSize int
	// ShimGroupGrace is how long a group's shim stays up serving no member (the
	// keep-alive a draining pool refills into). 0 means the shim's default.
	ShimGroupGrace time.Duration
}

// DefaultShimGroupSize: a shim costs ~19 MB, a member in a shared one a few hundred KB.
const DefaultShimGroupSize = 100

// Validate checks a template and fills its defaults.
func (t *Template) Validate() error {
	bad := func(f string, a ...any) error { return fmt.Errorf("pool %q: "+f, append([]any{t.Name}, a...)...) }
	if t.Name == "" || len(t.Name) > 32 || path.Base(t.Name) != t.Name {
		return fmt.Errorf("pool name %q: want 1-32 characters, no '/'", t.Name)
	}
	if t.Image == "" {
		return bad("needs an image")
	}
	if len(t.Namespaces) == 0 {
		t.Namespaces = DefaultNamespaces
	}
	t.Namespaces = slices.Clone(t.Namespaces)
	for i, ns := range t.Namespaces {
		if err := identifiers.Validate(ns); err != nil {
			return bad("namespaces: %v", err)
		}
		if slices.Contains(t.Namespaces[:i], ns) {
			return bad("namespaces: %q is listed twice", ns)
		}
	}
	if t.Runtime == "" {
		t.Runtime = "runc"
	}
	if t.Runtime == "kata-fc" {
		// A member is a runc container frozen around a holder that receives the
		// workload over a bind-mounted socket; a Firecracker VM has neither the bind
		// mount (no virtio-fs) nor the freezer. The plan is contrib/kata-fc/pools.md.
		return bad("runtime %q: warm VM members are not offered (the plan is contrib/kata-fc/pools.md); members run on a runc-kind route (runc, runsc)", t.Runtime)
	}
	if t.Workdir == "" {
		t.Workdir = binding.DefaultWorkdir
	}
	wd, err := binding.ParseWorkdir(t.Workdir)
	if err != nil {
		return bad("workdir: %v", err)
	}
	t.Workdir = wd
	if t.Owner == "" {
		t.Owner = "0:0"
	}
	if _, _, err := binding.ParseOwner(t.Owner); err != nil {
		return bad("owner: %v", err)
	}
	if t.Target <= 0 {
		t.Target = 1
	}
	if t.Max == 0 {
		t.Max = 2 * t.Target
	}
	if t.Min < 0 || t.Min > t.Target || t.Target > t.Max {
		return bad("sizes must satisfy 0 <= min (%d) <= target (%d) <= max (%d)", t.Min, t.Target, t.Max)
	}
	if t.RefillRate <= 0 {
		t.RefillRate = 5
	}
	if t.MaxAge <= 0 {
		t.MaxAge = time.Hour
	}
	if t.ShimGroupSize == 0 {
		t.ShimGroupSize = DefaultShimGroupSize
	}
	if t.ShimGroupSize < 0 || t.ShimGroupGrace < 0 || t.ShimGroupGrace > time.Hour {
		return bad("shim_group_size must be positive and shim_group_grace within 0s-1h")
	}
	if t.CPUs < 0 || t.Memory < 0 {
		return bad("resources must not be negative")
	}
	return nil
}

// annotations route members through the shim's route of that name and into the
// pool's shim groups. (Not dev.tidepool.pool: that is how a container asks to adopt a
// member.)
func (t *Template) annotations(memberID string) map[string]string {
	ann := map[string]string{
		binding.AnnotationRuntime: t.Runtime,
		LabelMember:               memberID,
	}
	if g := t.shimGroup(memberID); g != "" {
		// A grouped shim stays up for its grace once empty, and a create racing its
		// exit lands in a fresh one (shim/group.go): draining never races refills.
		ann[binding.AnnotationShimGroup] = g
		if t.ShimGroupGrace > 0 {
			ann[binding.AnnotationShimGroupGrace] = t.ShimGroupGrace.String()
		}
	}
	return ann
}

// shimGroup spreads members over ceil(Target/ShimGroupSize) groups by their id; ""
// means a shim of the member's own.
func (t *Template) shimGroup(memberID string) string {
	if t.ShimGroupSize <= 1 {
		return ""
	}
	groups := (t.Target + t.ShimGroupSize - 1) / t.ShimGroupSize
	h := fnv.New32a()
	h.Write([]byte(memberID))
	return fmt.Sprintf("pool.%s.%d", t.Name, h.Sum32()%uint32(max(groups, 1)))
}

package binding

// Shim groups: warm pool members share shim processes. The pool sets these on its
// members; containerd-shim-tidepool-v1 reads them at start.
const (
	// AnnotationShimGroup names the group whose shim serves the container: every
	// container of one group (in one namespace, under one containerd) is served by
	// one shim process while that shim lives.
	AnnotationShimGroup = AnnotationPrefix + "shim-group"
	// AnnotationShimGroupGrace is how long a group's shim stays up once it serves no
	// container (a Go duration, e.g. "5s"): the keep-alive that lets a draining pool
	// refill into the same shim.
	AnnotationShimGroupGrace = AnnotationPrefix + "shim-group-grace"
)

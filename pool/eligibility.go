package pool

import (
	"fmt"
	"path"
	"reflect"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// How a field of the container's OCI spec is treated when it adopts a member that runc
// created from the member's own spec.
type handling int

const (
	// compared: fixed when runc creates the container (namespaces, mounts, security,
	// the user...); the container's value must equal the member's, or it starts cold
	// with the rule's reason.
	compared handling = iota
	// applied: the container's value takes effect at claim, so the member's does not
	// matter (argv/env/cwd through the holder; cgroup and resources by moving the
	// member's processes into the container's own cgroup, made with its resources).
	applied
	// ignored: has no effect on what the workload runs with.
	ignored
)

// specRule classifies one field of specs.Spec, named by its Go path ("Linux.Resources").
type specRule struct {
	field  string
	how    handling
	reason string // compared: the cold-fallback reason, as counted in the metrics
	why    string // applied, ignored: why that is safe
}

// specRules covers every field of specs.Spec, at the depth where one decision holds for
// the whole field. TestSpecRulesCoverEverySpecField walks the runtime-spec structs, so a
// field a later runtime-spec adds fails that test until it is classified here. Order
// matters only for which reason a container that differs in several ways is counted
// under.
var specRules = []specRule{
	{field: "Version", how: ignored, why: "the spec's version string; runc reads every version it supports alike"},
	{field: "Process.Terminal", how: compared, reason: "terminal"},
	{field: "Process.ConsoleSize", how: compared, reason: "terminal"},
	{field: "Process.User", how: compared, reason: "user"},
	{field: "Process.Args", how: applied, why: "the holder execs the container's argv at start"},
	{field: "Process.CommandLine", how: compared, reason: "process"},
	{field: "Process.Env", how: applied, why: "the holder execs with the container's environment"},
	{field: "Process.Cwd", how: applied, why: "the holder enters the container's working directory before exec"},
	{field: "Process.Capabilities", how: compared, reason: "capabilities"},
	{field: "Process.Rlimits", how: compared, reason: "rlimits"},
	{field: "Process.NoNewPrivileges", how: compared, reason: "security"},
	{field: "Process.ApparmorProfile", how: compared, reason: "security"},
	{field: "Process.OOMScoreAdj", how: compared, reason: "oom_score_adj"},
	{field: "Process.Scheduler", how: compared, reason: "scheduler"},
	{field: "Process.SelinuxLabel", how: compared, reason: "security"},
	{field: "Process.IOPriority", how: compared, reason: "io_priority"},
	{field: "Process.ExecCPUAffinity", how: compared, reason: "cpu_affinity"},
	{field: "Root", how: compared, reason: "root"},
	{field: "Hostname", how: compared, reason: "hostname"},
	{field: "Domainname", how: compared, reason: "domainname"},
	{field: "Mounts", how: compared, reason: "mounts"},
	{field: "Hooks", how: compared, reason: "hooks"},
	{field: "Annotations", how: ignored, why: "runc does not act on them; the shim reads the tidepool ones (runtime, fork, workdir, owner) and compares or applies them itself"},
	{field: "Linux.UIDMappings", how: compared, reason: "user_namespace"},
	{field: "Linux.GIDMappings", how: compared, reason: "user_namespace"},
	{field: "Linux.Sysctl", how: compared, reason: "sysctl"},
	{field: "Linux.Resources", how: applied, why: "the member's processes move into the container's own cgroup, created with these resources, before the workload starts"},
	{field: "Linux.CgroupsPath", how: applied, why: "the member's processes move into a cgroup made at this path before the workload starts"},
	{field: "Linux.Namespaces", how: compared, reason: "namespaces"},
	{field: "Linux.Devices", how: compared, reason: "devices"},
	{field: "Linux.NetDevices", how: compared, reason: "net_devices"},
	{field: "Linux.Seccomp", how: compared, reason: "seccomp"},
	{field: "Linux.RootfsPropagation", how: compared, reason: "rootfs_propagation"},
	{field: "Linux.MaskedPaths", how: compared, reason: "masked_paths"},
	{field: "Linux.ReadonlyPaths", how: compared, reason: "readonly_paths"},
	{field: "Linux.MountLabel", how: compared, reason: "security"},
	{field: "Linux.IntelRdt", how: compared, reason: "intel_rdt"},
	{field: "Linux.MemoryPolicy", how: compared, reason: "memory_policy"},
	{field: "Linux.Personality", how: compared, reason: "personality"},
	{field: "Linux.TimeOffsets", how: compared, reason: "time_namespace"},
	{field: "Solaris", how: compared, reason: "platform"},
	{field: "Windows", how: compared, reason: "platform"},
	{field: "VM", how: compared, reason: "platform"},
	{field: "ZOS", how: compared, reason: "platform"},
	{field: "FreeBSD", how: compared, reason: "platform"},
}

// ineligible compares a container's spec with a member's: everything runc fixes when it
// creates a container must be the same, except what is applied at claim (specRules).
// It returns the first difference as a cold-fallback reason, or "".
func ineligible(member, req *specs.Spec) string {
	if req == nil || member == nil || req.Process == nil || member.Process == nil || req.Linux == nil || member.Linux == nil {
		return "spec"
	}
	for _, r := range specRules {
		if r.how != compared {
			continue
		}
		mv, rv := specField(member, r.field), specField(req, r.field)
		if r.field == "Mounts" {
			mv = reflect.ValueOf(memberMounts(member))
		}
		if !equalValues(mv, rv) {
			return r.reason
		}
	}
	return claimCgroupReason(req.Linux)
}

// claimCgroupReason says why the container's own cgroup cannot be made at claim, or "".
func claimCgroupReason(l *specs.Linux) string {
	switch p := l.CgroupsPath; {
	case p == "":
		// runc would choose one; we cannot know which.
		return "cgroups_path"
	case !strings.HasPrefix(p, "/") || path.Clean(p) != p || p == "/":
		// "slice:prefix:name" is systemd's driver, which owns its units.
		return "cgroups_path_systemd"
	}
	r := l.Resources
	switch {
	case r == nil:
	case len(r.Unified) > 0:
		return "resources_unified"
	case r.CPU != nil && (r.CPU.Burst != nil || r.CPU.Idle != nil):
		// containerd's cgroup v1 library, which makes the container's cgroup, does
		// not set these; the container would run without them.
		return "resources_unsupported"
	}
	return ""
}

// specField returns a field of a spec by its Go path; a nil pointer on the way gives
// the field's zero value.
func specField(s *specs.Spec, field string) reflect.Value {
	v := reflect.ValueOf(s).Elem()
	parts := strings.Split(field, ".")
	for i, name := range parts {
		f, ok := v.Type().FieldByName(name)
		if !ok {
			panic(fmt.Sprintf("pool: specRules names %q, which specs.Spec does not have", field))
		}
		v = v.FieldByIndex(f.Index)
		if i < len(parts)-1 {
			if v.Kind() == reflect.Pointer {
				if v.IsNil() {
					return zeroAt(v.Type().Elem(), parts[i+1:])
				}
				v = v.Elem()
			}
		}
	}
	return v
}

func zeroAt(t reflect.Type, parts []string) reflect.Value {
	for _, name := range parts {
		f, _ := t.FieldByName(name)
		t = f.Type
		if t.Kind() == reflect.Pointer && name != parts[len(parts)-1] {
			t = t.Elem()
		}
	}
	return reflect.Zero(t)
}

// equalValues is reflect.DeepEqual, except that an empty slice or map equals a nil one
// (JSON round trips do not keep the difference, and runc does not see it).
func equalValues(a, b reflect.Value) bool {
	if (a.Kind() == reflect.Slice || a.Kind() == reflect.Map) && a.Len() == 0 && b.Len() == 0 {
		return true
	}
	return reflect.DeepEqual(a.Interface(), b.Interface())
}

// memberMounts are a member's mounts without the holder's own.
func memberMounts(s *specs.Spec) []specs.Mount {
	var out []specs.Mount
	for _, m := range s.Mounts {
		if !strings.HasPrefix(m.Destination, "/.tidepool/") {
			out = append(out, m)
		}
	}
	return out
}

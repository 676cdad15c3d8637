package pool

import (
	"encoding/json"
	"reflect"
	"sort"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// TestSpecRulesCoverEverySpecField walks runtime-spec's structs: every exported field
// of specs.Spec must be classified in specRules (compared, applied at claim, ignored
// with a reason), at its own level or as part of a classified parent. A field a later
// runtime-spec adds fails here until someone decides what a claim does with it.
func TestSpecRulesCoverEverySpecField(t *testing.T) {
	rules := map[string]specRule{}
	for _, r := range specRules {
		if _, dup := rules[r.field]; dup {
			t.Errorf("%s is classified twice", r.field)
		}
		rules[r.field] = r
		switch {
		case r.how == compared && r.reason == "":
			t.Errorf("%s is compared but names no cold-fallback reason", r.field)
		case r.how != compared && r.why == "":
			t.Errorf("%s is applied or ignored without saying why", r.field)
		}
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Errorf("rule names a field specs.Spec does not have: %v", p)
				}
			}()
			specField(&specs.Spec{}, r.field)
		}()
	}
	var missing []string
	var walk func(reflect.Type, string)
	walk = func(typ reflect.Type, prefix string) {
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			if !f.IsExported() {
				continue
			}
			p := prefix + f.Name
			if _, ok := rules[p]; ok {
				continue
			}
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct && hasRuleUnder(rules, p) {
				walk(ft, p+".")
				continue
			}
			missing = append(missing, p)
		}
	}
	walk(reflect.TypeOf(specs.Spec{}), "")
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Fatalf("specs.Spec fields no rule classifies (add them to specRules): %s", strings.Join(missing, ", "))
	}
}

func hasRuleUnder(rules map[string]specRule, p string) bool {
	for k := range rules {
		if strings.HasPrefix(k, p+".") {
			return true
		}
	}
	return false
}

// baseSpec is a member's spec as the pool makes it (containerd's defaults, the image's
// process, the holder's mounts); the container's starts as a copy without those.
func baseSpec() (member, req *specs.Spec) {
	limit := int64(128 << 20)
	member = &specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			User: specs.User{UID: 0, GID: 0}, Args: []string{"/.tidepool/holder", "/.tidepool/run"},
			Env: []string{"PATH=/usr/bin:/bin"}, Cwd: "/",
			Capabilities:    &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN"}, Effective: []string{"CAP_CHOWN"}, Permitted: []string{"CAP_CHOWN"}},
			Rlimits:         []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 1024, Soft: 1024}},
			NoNewPrivileges: true,
		},
		Root: &specs.Root{Path: "rootfs"},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/.tidepool/holder", Type: "bind", Source: "/usr/bin/tidepool-holder", Options: []string{"rbind", "ro"}},
			{Destination: "/.tidepool/run", Type: "bind", Source: "/var/lib/tidepool/pools/m", Options: []string{"rbind", "rw"}},
		},
		Annotations: map[string]string{"dev.tidepool.runtime": "runc", "dev.tidepool.member": "node-1"},
		Linux: &specs.Linux{
			CgroupsPath: "/tidepool/node-1",
			Resources:   &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}},
			Namespaces:  []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.NetworkNamespace}},
			MaskedPaths: []string{"/proc/kcore"}, ReadonlyPaths: []string{"/proc/sys"},
		},
	}
	req = clone(member)
	req.Mounts = req.Mounts[:1]
	req.Process.Args, req.Process.Cwd = []string{"sh", "-c", "make"}, "/app"
	req.Annotations = map[string]string{"dev.tidepool.pool": "node"}
	req.Linux.CgroupsPath = "/tidepool/ctr-1"
	req.Linux.Resources = nil
	return member, req
}

func clone(s *specs.Spec) *specs.Spec {
	b, err := json.Marshal(s)
	if err != nil {
		panic(err)
	}
	var out specs.Spec
	if err := json.Unmarshal(b, &out); err != nil {
		panic(err)
	}
	return &out
}

// nonZero builds a value of any runtime-spec type that differs from its zero value.
func nonZero(t reflect.Type) reflect.Value {
	v := reflect.New(t).Elem()
	switch t.Kind() {
	case reflect.Bool:
		v.SetBool(true)
	case reflect.String:
		v.SetString("/differs")
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(7)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(7)
	case reflect.Float32, reflect.Float64:
		v.SetFloat(7)
	case reflect.Pointer:
		v.Set(reflect.New(t.Elem()))
		v.Elem().Set(nonZero(t.Elem()))
	case reflect.Slice:
		v.Set(reflect.Append(reflect.MakeSlice(t, 0, 1), nonZero(t.Elem())))
	case reflect.Map:
		v.Set(reflect.MakeMap(t))
		v.SetMapIndex(nonZero(t.Key()), nonZero(t.Elem()))
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			if t.Field(i).IsExported() {
				v.Field(i).Set(nonZero(t.Field(i).Type))
				break
			}
		}
	}
	return v
}

// setField sets a field of s by its Go path, allocating pointers on the way.
func setField(s *specs.Spec, field string, val func(reflect.Type) reflect.Value) {
	v := reflect.ValueOf(s).Elem()
	parts := strings.Split(field, ".")
	for i, name := range parts {
		v = v.FieldByName(name)
		if i < len(parts)-1 && v.Kind() == reflect.Pointer {
			if v.IsNil() {
				v.Set(reflect.New(v.Type().Elem()))
			}
			v = v.Elem()
		}
	}
	v.Set(val(v.Type()))
}

// TestIneligibleEveryField: for every classified field, a container differing from
// the member in that field alone starts cold with the rule's reason (compared), or
// adopts the member (applied, ignored).
func TestIneligibleEveryField(t *testing.T) {
	member, req := baseSpec()
	if r := ineligible(member, req); r != "" {
		t.Fatalf("the base container is refused: %s", r)
	}
	for _, rule := range specRules {
		t.Run(rule.field, func(t *testing.T) {
			_, req := baseSpec()
			setField(req, rule.field, func(typ reflect.Type) reflect.Value {
				if rule.field == "Linux.CgroupsPath" {
					return reflect.ValueOf("/elsewhere/ctr-1")
				}
				if v := nonZero(typ); !reflect.DeepEqual(v.Interface(), specField(member, rule.field).Interface()) {
					return v
				}
				return reflect.Zero(typ)
			})
			if reflect.DeepEqual(specField(member, rule.field).Interface(), specField(req, rule.field).Interface()) {
				t.Fatalf("test setup: %s does not differ", rule.field)
			}
			want := ""
			if rule.how == compared {
				want = rule.reason
			}
			if got := ineligible(member, req); got != want {
				t.Fatalf("%s differs: reason %q, want %q", rule.field, got, want)
			}
		})
	}
}

// TestIneligibleCases are the decisions that matter most, spelled out.
func TestIneligibleCases(t *testing.T) {
	limit := int64(64 << 20)
	for _, tc := range []struct {
		name string
		edit func(*specs.Spec)
		want string
	}{
		{"same", func(*specs.Spec) {}, ""},
		{"memory limit is applied at claim", func(s *specs.Spec) {
			s.Linux.Resources = &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}}
		}, ""},
		{"no cgroup path", func(s *specs.Spec) { s.Linux.CgroupsPath = "" }, "cgroups_path"},
		{"systemd cgroup path", func(s *specs.Spec) { s.Linux.CgroupsPath = "kubepods.slice:cri-containerd:abc" }, "cgroups_path_systemd"},
		{"relative cgroup path", func(s *specs.Spec) { s.Linux.CgroupsPath = "tidepool/x" }, "cgroups_path_systemd"},
		{"unclean cgroup path", func(s *specs.Spec) { s.Linux.CgroupsPath = "/a/../b" }, "cgroups_path_systemd"},
		{"cgroup v2 only resources", func(s *specs.Spec) {
			s.Linux.Resources = &specs.LinuxResources{Unified: map[string]string{"memory.high": "1"}}
		}, "resources_unified"},
		{"cpu burst", func(s *specs.Spec) {
			b := uint64(1000)
			s.Linux.Resources = &specs.LinuxResources{CPU: &specs.LinuxCPU{Burst: &b}}
		}, "resources_unsupported"},
		{"cpu quota is applied at claim", func(s *specs.Spec) {
			q, p := int64(50000), uint64(100000)
			s.Linux.Resources = &specs.LinuxResources{CPU: &specs.LinuxCPU{Quota: &q, Period: &p}}
		}, ""},
		{"terminal", func(s *specs.Spec) { s.Process.Terminal = true }, "terminal"},
		{"other user", func(s *specs.Spec) { s.Process.User.UID = 1000 }, "user"},
		{"extra group", func(s *specs.Spec) { s.Process.User.AdditionalGids = []uint32{10} }, "user"},
		{"more capabilities", func(s *specs.Spec) {
			s.Process.Capabilities.Bounding = append(s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN")
		}, "capabilities"},
		{"privileges", func(s *specs.Spec) { s.Process.NoNewPrivileges = false }, "security"},
		{"oom score", func(s *specs.Spec) { v := 500; s.Process.OOMScoreAdj = &v }, "oom_score_adj"},
		{"extra mount", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/host-etc", Source: "/etc", Type: "bind"})
		}, "mounts"},
		{"host network", func(s *specs.Spec) { s.Linux.Namespaces = s.Linux.Namespaces[:2] }, "namespaces"},
		{"propagation", func(s *specs.Spec) { s.Linux.RootfsPropagation = "shared" }, "rootfs_propagation"},
		{"unmasked", func(s *specs.Spec) { s.Linux.MaskedPaths = nil }, "masked_paths"},
		{"personality", func(s *specs.Spec) { s.Linux.Personality = &specs.LinuxPersonality{Domain: specs.PerLinux32} }, "personality"},
		{"domainname", func(s *specs.Spec) { s.Domainname = "example" }, "domainname"},
		{"other argv, env, cwd", func(s *specs.Spec) {
			s.Process.Args, s.Process.Env, s.Process.Cwd = []string{"x"}, []string{"A=1"}, "/x"
		}, ""},
		{"empty and nil sysctl", func(s *specs.Spec) { s.Linux.Sysctl = map[string]string{} }, ""},
		{"no process", func(s *specs.Spec) { s.Process = nil }, "spec"},
		{"no linux", func(s *specs.Spec) { s.Linux = nil }, "spec"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			member, req := baseSpec()
			tc.edit(req)
			if got := ineligible(member, req); got != tc.want {
				t.Fatalf("reason %q, want %q", got, tc.want)
			}
		})
	}
	if got := ineligible(nil, nil); got != "spec" {
		t.Fatalf("nil specs: %q", got)
	}
}

package hostcheck

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Cgroups reports the cgroup version (containers need one) and whether the freezer
// is there (warm pool members are frozen while idle).
func Cgroups() []Check {
	ver := Check{Name: "cgroups", Required: true, Fix: "mount cgroups at /sys/fs/cgroup (v2 unified, or v1 hierarchies)"}
	frz := Check{Name: "cgroup freezer", Fix: "cgroup v2 (cgroup.freeze, kernel >= 5.2) or the v1 freezer hierarchy at /sys/fs/cgroup/freezer; warm pools need it"}
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		return []Check{failed(ver, Missing, err), failed(frz, Missing, err)}
	}
	switch st.Type {
	case unix.CGROUP2_SUPER_MAGIC:
		ver.Status, ver.Detail = OK, "v2 (unified)"
		if _, err := os.Stat("/sys/fs/cgroup/cgroup.freeze"); err == nil {
			frz.Status, frz.Detail = OK, "v2 cgroup.freeze"
		} else if _, err := os.Stat("/sys/fs/cgroup/init.scope/cgroup.freeze"); err == nil {
			frz.Status, frz.Detail = OK, "v2 cgroup.freeze"
		} else {
			frz = failed(frz, Missing, fmt.Errorf("no cgroup.freeze in the v2 hierarchy"))
		}
	default:
		ver.Status, ver.Detail = OK, "v1"
		if _, err := os.Stat("/sys/fs/cgroup/unified/cgroup.controllers"); err == nil {
			ver.Detail = "v1 (hybrid: v2 unified hierarchy at /sys/fs/cgroup/unified)"
		}
		var fst unix.Statfs_t
		if err := unix.Statfs("/sys/fs/cgroup/freezer", &fst); err == nil && fst.Type == unix.CGROUP_SUPER_MAGIC {
			frz.Status, frz.Detail = OK, "v1 freezer hierarchy"
		} else {
			frz = failed(frz, Missing, fmt.Errorf("no v1 freezer hierarchy at /sys/fs/cgroup/freezer"))
		}
	}
	return []Check{ver, frz}
}

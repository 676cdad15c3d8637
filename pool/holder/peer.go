package holder

import (
	"bufio"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Peer is who must be listening on a member's control socket: its holder, pid 1 of
// the member's task, as the host sees it, in the cgroup the member's processes live
// in. A socket in the control directory that anything else bound (a local user who
// got at the directory, a stale process whose pid was reused) does not match.
type Peer struct {
	Pid int32
	// Cgroup is the path (relative to the hierarchy's root, as /proc/PID/cgroup
	// shows it) the holder must be in; "" skips that check.
	Cgroup string
}

// Check compares a listener's SO_PEERCRED with the expected holder.
func (p Peer) Check(cred *unix.Ucred) error {
	if p.Pid <= 0 {
		return fmt.Errorf("no holder pid to check the listener against")
	}
	if cred.Pid != p.Pid {
		return fmt.Errorf("the listener is pid %d (uid %d), not the member's holder, pid %d", cred.Pid, cred.Uid, p.Pid)
	}
	if p.Cgroup == "" {
		return nil
	}
	in, err := InCgroup(int(cred.Pid), p.Cgroup)
	if err != nil {
		return err
	}
	if !in {
		return fmt.Errorf("pid %d is not in the member's cgroup %s", cred.Pid, p.Cgroup)
	}
	return nil
}

// InCgroup says whether a process is in the cgroup at path: on cgroup v2 its one
// path, on v1 its path in every hierarchy of a controller a container is confined by
// (runc places its processes in all of them).
func InCgroup(pid int, cg string) (bool, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return false, fmt.Errorf("cgroup of pid %d: %w", pid, err)
	}
	defer f.Close()
	return inCgroup(bufio.NewScanner(f), cg)
}

// confining are the v1 controllers whose path must match; named hierarchies and
// controllers runc may leave alone (net_cls on a host without it, say) are not
// looked at.
var confining = map[string]bool{"memory": true, "pids": true, "freezer": true, "cpu": true, "devices": true}

func inCgroup(sc *bufio.Scanner, cg string) (bool, error) {
	want := path.Clean("/" + cg)
	v1, v1Match, v2Match := false, true, false
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		got := path.Clean(parts[2])
		if parts[0] == "0" && parts[1] == "" {
			v2Match = got == want
			continue
		}
		for _, ctl := range strings.Split(parts[1], ",") {
			if confining[ctl] {
				v1 = true
				v1Match = v1Match && got == want
			}
		}
	}
	if err := sc.Err(); err != nil {
		return false, err
	}
	if v1 {
		// On a hybrid host the unified line belongs to systemd, not to runc.
		return v1Match, nil
	}
	return v2Match, nil
}

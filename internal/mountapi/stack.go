package mountapi

import (
	"fmt"

	"github.com/moby/sys/mountinfo"
)

// Stack returns every mount at dir (a clean absolute path), lowest first: the last is
// the one a path walk of dir finds. mountinfo.SingleEntryFilter would stop at the
// lowest, which is not what is there once something is mounted over it (a view over
// a pool member's slot, a mount over a kernel view).
func Stack(dir string) ([]*mountinfo.Info, error) {
	ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) { return m.Mountpoint != dir, false })
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	return ms, nil
}

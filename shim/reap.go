package shim

import (
	"os"
	"os/signal"

	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/sys/reaper"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// Reaping children without head-of-line blocking.
//
// containerd's shim library reaps on SIGCHLD in one loop: reaper.Reap collects every
// exited child, then hands each exit to every subscriber (the runc task service's
// exit processor, and one channel per runc command under way) and waits up to a
// second per exit for all of them to take it before it collects again. The runc
// task service's exit processor can itself wait on a runc command: handling a
// container's exit takes the container's init lock (process.Init.ExitedAt), and a
// Kill or Delete of that container holds the same lock while `runc kill` or `runc
// delete` runs, which returns only once the reaper delivers that runc's own exit. So
// when a Kill or Delete lands while the exit of its container is being processed (a
// pool member torn down right after its workload ended, with the exit status file's
// fsync slow), the exit processor blocks, its channel (32 exits) fills, and from then
// on every exit costs the loop a full second: the runc command's exit waits behind
// all of them, and the exits of every other container of the shim (a warm pool's
// members share one) are reported tens of seconds late. Seen in bursts of 50 claims:
// workloads exited, their processes zombies of the shim, their exits reaching
// tidepoold 13 to 55 s later.
//
// A shim serving many containers cannot let one stalled exit hold up the rest, so the
// tidepool shim turns the library's loop off (Config.NoReaper) and runs each reap on
// SIGCHLD in a goroutine of its own: a reap whose notifications wait does not stop the
// next from collecting the runc command's exit and delivering it to its waiter, which
// releases the lock, which lets the exit processor go on. Notifications of different
// reaps may reach subscribers in either order; each carries its pid and status, and
// runc's exit processing looks exits up by pid, as it does for one reap's batch.
// (containerd is moving the same way upstream: containerd/containerd#13544 decouples
// Reap from notification delivery.)

// WithConcurrentReaper is the RunShim option that turns the library's serial reaper
// off; serveChildExits, started with the task service, takes its place.
func WithConcurrentReaper(c *shim.Config) { c.NoReaper = true }

// serveChildExits reaps on every SIGCHLD, each reap in its own goroutine. It must be
// running before the first child is started (the task service's init does that).
func serveChildExits() {
	signals := make(chan os.Signal, 128)
	signal.Notify(signals, unix.SIGCHLD)
	go func() {
		for range signals {
			go func() {
				if err := reaper.Reap(); err != nil {
					log.L.WithError(err).Error("reap exit status")
				}
			}()
		}
	}()
	// A child that exited before the handler was installed sent its SIGCHLD to
	// nobody: collect whatever is there now.
	go reaper.Reap()
}

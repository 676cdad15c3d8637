// Command pause is the sandbox (pod) process of the CRI test image: it holds
// the namespaces open, reaps the zombies a PID-namespace init inherits, and
// exits 0 on SIGTERM or SIGINT. Built static (CGO_ENABLED=0) by imagebuild.Pause.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 16)
	// As PID 1 a process gets no default signal dispositions: without handlers,
	// SIGTERM would be ignored and the runtime would have to SIGKILL us.
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range sigs {
		switch sig {
		case syscall.SIGCHLD:
			reap()
		default:
			fmt.Fprintf(os.Stderr, "pause: %v, exiting\n", sig)
			os.Exit(0)
		}
	}
}

// reap collects every exited child; one SIGCHLD may stand for several exits.
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}

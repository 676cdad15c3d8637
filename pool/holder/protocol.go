// Package holder is the protocol between tidepoold and tidepool-holder, pid 1 of a
// warm-pool member: how the daemon hands a frozen member its workload. It is kept
// apart from the pool controller so the static holder links nothing else.
package holder

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Paths of the holder inside a member container. The holder binary is bind-mounted
// read-only from the host; the control directory is the member's directory on the host.
const (
	HolderPath   = "/.tidepool/holder"
	ControlDir   = "/.tidepool/run"
	ControlName  = "ctl.sock"
	ReadyName    = "ready"
	maxRequestSz = 1 << 20
)

// ExecRequest is what the holder is told to become: the workload's argv, environment
// and working directory, late-bound at claim time. Stdio, when Fds is set, arrives as
// descriptors with the message (stdin, stdout, stderr in that order).
type ExecRequest struct {
	Args []string `json:"args"`
	Env  []string `json:"env"`
	Cwd  string   `json:"cwd"`
	Fds  bool     `json:"fds"`
}

// SendExec connects to a member's holder and hands it the workload. The holder may be
// frozen: the connection completes in the kernel's backlog and the message waits in
// the socket until the holder thaws and reads it.
func SendExec(sock string, req ExecRequest, stdio []*os.File) error {
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if len(b) > maxRequestSz {
		return fmt.Errorf("exec request of %d bytes is too large", len(b))
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("holder socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
		return fmt.Errorf("connect to holder %s: %w", sock, err)
	}
	var oob []byte
	if req.Fds {
		fds := make([]int, len(stdio))
		for i, f := range stdio {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	// The length prefix lets the holder read exactly one message whatever the
	// socket's buffering.
	msg := append(binaryLen(len(b)), b...)
	if err := unix.Sendmsg(fd, msg, oob, nil, 0); err != nil {
		return fmt.Errorf("send to holder %s: %w", sock, err)
	}
	return nil
}

func binaryLen(n int) []byte {
	return []byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
}

// ErrNotReady says a holder did not come up in time.
var ErrNotReady = errors.New("holder not ready")

// WaitReady waits until the holder in dir has its control socket listening.
func WaitReady(dir string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for delay := 200 * time.Microsecond; ; delay = min(2*delay, 10*time.Millisecond) {
		if _, err := os.Stat(dir + "/" + ReadyName); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w after %s (%s)", ErrNotReady, timeout, dir)
		}
		time.Sleep(delay)
	}
}

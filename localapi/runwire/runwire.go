// Package runwire is the wire protocol of tidepoold's run socket, the path `tidepool
// run` takes to a warm pool member.
//
// Why a protocol beside the gRPC API: a warm claim takes about 20 ms inside
// tidepoold, and the CLI process that asks for it used to cost twice that just to
// start (a 35 MB binary with ~300 package inits). The run socket lets a small front
// binary (cmd/tidepool) make the claim with the standard library alone, and it hands
// the caller's stdio descriptors to tidepoold (SCM_RIGHTS), which passes them on to
// the member's holder: the workload writes straight into the caller's pipes, with no
// relay in between. Only pipes are handed over; a terminal, file or socket is relayed
// through a pipe by the client, so a container never holds a descriptor it could
// reopen (through /proc/self/fd) or use against the caller's terminal.
//
// The protocol: frames of a 4-byte big-endian length and a JSON body, at most
// MaxFrame bytes. The client sends a Request with Start and the three stdio
// descriptors in the first frame, then Requests carrying signals to forward; the
// server answers with Responses: Started once the workload runs, then exactly one of
// Exit or Error, and closes. A client that goes away ends the workload (its changes
// are still committed). A Branch (branch.go) is the other request: one frame, no
// descriptors, answered by one Branched or Error. The socket is 0600 root, peers are
// checked on both ends.
//
// This package imports the standard library and golang.org/x/sys/unix only: it is
// linked into the front binary, whose start-up time is the point.
package runwire

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// MaxFrame bounds one frame's body.
const MaxFrame = 1 << 20

// Address is the run socket of the tidepoold whose API socket is api: the same
// directory, "-run" added to the name before ".sock".
func Address(api string) string {
	return strings.TrimSuffix(api, ".sock") + "-run.sock"
}

// Start asks for a run: the pool, the fork and the workload.
type Start struct {
	Pool    string   `json:"pool"`
	Fork    string   `json:"fork,omitempty"`
	Env     []string `json:"env,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	Args    []string `json:"args"`
	Discard bool     `json:"discard,omitempty"`
}

// Request is a client frame: the Start (first frame only, with the stdio
// descriptors) or a signal for the workload.
type Request struct {
	Start  *Start  `json:"start,omitempty"`
	Signal int     `json:"signal,omitempty"`
	Branch *Branch `json:"branch,omitempty"` // alone, as the only frame (branch.go)
}

// Step is one timed stage of the run inside tidepoold.
type Step struct {
	Name string  `json:"name"`
	Ms   float64 `json:"ms"`
}

// Exit is how the workload ended and where its changes went.
type Exit struct {
	Status  int     `json:"status"`
	Member  string  `json:"member"`
	ForkID  string  `json:"fork_id,omitempty"`
	Root    string  `json:"root,omitempty"`
	ClaimMs float64 `json:"claim_ms"`
	Steps   []Step  `json:"steps,omitempty"`
}

// Error is a run that failed before it had a workload status.
type Error struct {
	// Code is containerd's errdefs name of the failure ("not found", "invalid
	// argument", ...), or "" for an unclassified one.
	Code    string `json:"code,omitempty"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return e.Message }

// Response is a server frame.
type Response struct {
	Started  string    `json:"started,omitempty"`
	Exit     *Exit     `json:"exit,omitempty"`
	Error    *Error    `json:"error,omitempty"`
	Branched *Branched `json:"branched,omitempty"`
}

// ErrMalformed says a frame could not be read as the protocol's.
var ErrMalformed = errors.New("malformed run socket frame")

// WriteFrame writes v as one frame, with fds (if any) beside its first byte.
func WriteFrame(c *net.UnixConn, v any, fds []int) error {
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(body) > MaxFrame {
		return fmt.Errorf("%w: %d bytes, at most %d", ErrMalformed, len(body), MaxFrame)
	}
	msg := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(msg, uint32(len(body)))
	copy(msg[4:], body)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.WriteMsgUnix(msg, oob, nil)
	if err != nil {
		return err
	}
	if n < len(msg) {
		_, err = c.Write(msg[n:])
	}
	return err
}

// ReadFrame reads one frame into v and returns the descriptors that came with it
// (opened close-on-exec); on error none are left open. At most maxFds are accepted.
func ReadFrame(c *net.UnixConn, v any, maxFds int) ([]*os.File, error) {
	var files []*os.File
	fail := func(err error) ([]*os.File, error) {
		for _, f := range files {
			f.Close()
		}
		return nil, err
	}
	hdr := make([]byte, 4)
	oob := make([]byte, unix.CmsgSpace(4*max(maxFds, 1)))
	got := 0
	for got < len(hdr) {
		n, oobn, flags, _, err := c.ReadMsgUnix(hdr[got:], oob)
		if oobn > 0 {
			fds, perr := parseRights(oob[:oobn])
			for _, fd := range fds {
				files = append(files, os.NewFile(uintptr(fd), "run-stdio"))
			}
			if perr != nil {
				return fail(perr)
			}
		}
		if flags&unix.MSG_CTRUNC != 0 || len(files) > maxFds {
			return fail(fmt.Errorf("%w: more than %d descriptors", ErrMalformed, maxFds))
		}
		if err != nil {
			if errors.Is(err, io.EOF) && got == 0 && n == 0 {
				return fail(io.EOF)
			}
			return fail(err)
		}
		if n == 0 {
			return fail(io.ErrUnexpectedEOF)
		}
		got += n
	}
	l := binary.BigEndian.Uint32(hdr)
	if l > MaxFrame {
		return fail(fmt.Errorf("%w: a frame of %d bytes, at most %d", ErrMalformed, l, MaxFrame))
	}
	body := make([]byte, l)
	if _, err := io.ReadFull(c, body); err != nil {
		return fail(fmt.Errorf("%w: %w", ErrMalformed, err))
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fail(fmt.Errorf("%w: %w", ErrMalformed, err))
	}
	return files, nil
}

func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("%w: control message: %w", ErrMalformed, err)
	}
	var fds []int
	for _, m := range msgs {
		if rights, err := unix.ParseUnixRights(&m); err == nil {
			for _, fd := range rights {
				unix.CloseOnExec(fd)
			}
			fds = append(fds, rights...)
		}
	}
	return fds, nil
}

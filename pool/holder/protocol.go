// Package holder is the protocol between tidepoold and tidepool-holder, pid 1 of a
// warm-pool member: how the daemon hands a frozen member its workload. It is kept
// apart from the pool controller so the static holder links nothing else.
//
// The request carries the workload's argv, environment (secrets included) and stdio
// descriptors, so the sender proves who listens before it sends anything: the control
// directory is writable only by root and the holder's own uid, and the listener's
// SO_PEERCRED must name the member's holder (its pid, in its cgroup). See Peer.
package holder

import (
	"encoding/binary"
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
	HolderPath  = "/.tidepool/holder"
	ControlDir  = "/.tidepool/run"
	ControlName = "ctl.sock"
	ReadyName   = "ready"
	// MaxRequestSize bounds one request's JSON: a frame announcing more is refused
	// before anything is read into it.
	MaxRequestSize = 1 << 20
	headerSize     = 4
	stdioFds       = 3
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

// Frame errors, for callers and tests to tell them apart.
var (
	ErrTooLarge  = errors.New("holder request too large")
	ErrShort     = errors.New("holder request cut short")
	ErrMalformed = errors.New("malformed holder request")
)

// Encode frames a request: a 4-byte big-endian length, then the JSON.
func Encode(req ExecRequest) ([]byte, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxRequestSize {
		return nil, fmt.Errorf("%w: %d bytes (at most %d)", ErrTooLarge, len(b), MaxRequestSize)
	}
	out := make([]byte, headerSize, headerSize+len(b))
	binary.BigEndian.PutUint32(out, uint32(len(b)))
	return append(out, b...), nil
}

// frameLen returns the length a header announces, refusing more than MaxRequestSize.
func frameLen(hdr []byte) (int, error) {
	n := binary.BigEndian.Uint32(hdr[:headerSize])
	if n > MaxRequestSize {
		return 0, fmt.Errorf("%w: header announces %d bytes (at most %d)", ErrTooLarge, n, MaxRequestSize)
	}
	return int(n), nil
}

// Decode reads one whole frame (header and body, nothing after it) into a request and
// checks it: an argv, well-formed environment entries, no NUL anywhere.
func Decode(frame []byte) (ExecRequest, error) {
	var req ExecRequest
	if len(frame) < headerSize {
		return req, fmt.Errorf("%w: %d bytes, no header", ErrShort, len(frame))
	}
	n, err := frameLen(frame)
	if err != nil {
		return req, err
	}
	switch body := frame[headerSize:]; {
	case len(body) < n:
		return req, fmt.Errorf("%w: %d of %d bytes", ErrShort, len(body), n)
	case len(body) > n:
		return req, fmt.Errorf("%w: %d bytes after the frame", ErrMalformed, len(body)-n)
	}
	if err := json.Unmarshal(frame[headerSize:], &req); err != nil {
		return ExecRequest{}, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	return req, req.check()
}

func (r ExecRequest) check() error {
	if len(r.Args) == 0 || r.Args[0] == "" {
		return fmt.Errorf("%w: no command", ErrMalformed)
	}
	for _, s := range append(append([]string{r.Cwd}, r.Args...), r.Env...) {
		for i := 0; i < len(s); i++ {
			if s[i] == 0 {
				return fmt.Errorf("%w: NUL in %q", ErrMalformed, s)
			}
		}
	}
	for _, kv := range r.Env {
		if i := indexByte(kv, '='); i <= 0 {
			return fmt.Errorf("%w: environment entry %q is not KEY=VALUE", ErrMalformed, kv)
		}
	}
	if r.Cwd != "" && r.Cwd[0] != '/' {
		return fmt.Errorf("%w: working directory %q is not absolute", ErrMalformed, r.Cwd)
	}
	return nil
}

func indexByte(s string, c byte) int {
	for i := 0; i < len(s); i++ {
		if s[i] == c {
			return i
		}
	}
	return -1
}

// Receive reads exactly one framed request from a connected stream socket, however
// the kernel splits it, with the descriptors sent beside it. Descriptors that arrive
// with a request that is then refused are closed.
func Receive(fd int) (ExecRequest, []int, error) {
	var fds []int
	fail := func(err error) (ExecRequest, []int, error) {
		for _, f := range fds {
			unix.Close(f)
		}
		return ExecRequest{}, nil, err
	}
	hdr := make([]byte, headerSize)
	var body []byte
	oob := make([]byte, unix.CmsgSpace(stdioFds*4))
	got, want := 0, headerSize
	for got < want {
		var buf []byte
		if body == nil {
			buf = hdr[got:]
		} else {
			buf = body[got-headerSize:]
		}
		n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fail(fmt.Errorf("read request: %w", err))
		}
		if oobn > 0 {
			msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
			if err != nil {
				return fail(fmt.Errorf("%w: control message: %v", ErrMalformed, err))
			}
			for _, m := range msgs {
				if rights, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, rights...)
				}
			}
		}
		if n == 0 {
			return fail(fmt.Errorf("%w: %d of %d bytes", ErrShort, got, want))
		}
		got += n
		if got == headerSize && body == nil {
			l, err := frameLen(hdr)
			if err != nil {
				return fail(err)
			}
			body = make([]byte, l)
			want = headerSize + l
		}
	}
	req, err := Decode(append(hdr, body...))
	if err != nil {
		return fail(err)
	}
	want = 0
	if req.Fds {
		want = stdioFds
	}
	if len(fds) != want {
		return fail(fmt.Errorf("%w: request carries %d descriptors, want %d", ErrMalformed, len(fds), want))
	}
	return req, fds, nil
}

// SendExec connects to a member's holder, checks that the listener is want, and hands
// it the workload. The holder may be frozen: the connection completes in the
// kernel's backlog and the message waits in the socket until the holder thaws and
// reads it. Nothing is sent to a listener that is not the member's holder.
func SendExec(sock string, want Peer, req ExecRequest, stdio []*os.File) error {
	msg, err := Encode(req)
	if err != nil {
		return err
	}
	if req.Fds && len(stdio) != stdioFds {
		return fmt.Errorf("exec request: %d stdio descriptors, want %d", len(stdio), stdioFds)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("holder socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
		return fmt.Errorf("connect to holder %s: %w", sock, err)
	}
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return fmt.Errorf("credentials of the listener on %s: %w", sock, err)
	}
	if err := want.Check(cred); err != nil {
		return fmt.Errorf("refusing to hand the workload to the listener on %s: %w", sock, err)
	}
	var oob []byte
	if req.Fds {
		fds := make([]int, len(stdio))
		for i, f := range stdio {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	// One sendmsg carries the descriptors with the first byte; the length prefix lets
	// the holder read exactly one message whatever the socket's buffering.
	for sent := 0; sent < len(msg); {
		n, err := unix.SendmsgN(fd, msg[sent:], oob, nil, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("send to holder %s: %w", sock, err)
		}
		sent, oob = sent+n, nil
	}
	return nil
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

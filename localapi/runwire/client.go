package runwire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"

	"github.com/tidepool-dev/tidepool/internal/peercred"
)

// Stdio is what the workload's standard streams are connected to.
type Stdio struct {
	// Stdin nil: the workload reads /dev/null.
	Stdin          *os.File
	Stdout, Stderr *os.File
}

// Run asks the tidepoold listening on addr for a run, connects the workload to the
// caller's stdio and forwards signals until it exits. started, if set, is called
// with the member's id once the workload runs. A non-nil error means there is no
// workload status; an *Error is tidepoold's refusal.
func Run(addr string, start Start, stdio Stdio, signals <-chan os.Signal, started func(string)) (*Exit, error) {
	raw, err := net.Dial("unix", addr)
	if err != nil {
		return nil, fmt.Errorf("tidepoold run socket %s: %w", addr, err)
	}
	c := raw.(*net.UnixConn)
	defer c.Close()
	// The daemon must be root (or us): a socket someone else bound would receive the
	// workload and the caller's streams.
	if err := peercred.CheckConn(c); err != nil {
		return nil, fmt.Errorf("tidepoold run socket %s: %w", addr, err)
	}
	fds, relays, err := handOver(stdio)
	if err != nil {
		return nil, err
	}
	err = WriteFrame(c, Request{Start: &start}, fds.ints())
	fds.closeChildEnds() // tidepoold holds its own copies now
	if err != nil {
		relays.stop()
		return nil, fmt.Errorf("tidepoold run socket %s: send: %w", addr, err)
	}
	go func() {
		for sig := range signals {
			if s, ok := sig.(syscall.Signal); ok {
				if WriteFrame(c, Request{Signal: int(s)}, nil) != nil {
					return
				}
			}
		}
	}()
	for {
		var resp Response
		if _, err := ReadFrame(c, &resp, 0); err != nil {
			relays.stop()
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return nil, fmt.Errorf("tidepoold run socket %s: the daemon ended the run without a result", addr)
			}
			return nil, fmt.Errorf("tidepoold run socket %s: %w", addr, err)
		}
		switch {
		case resp.Error != nil:
			relays.stop()
			return nil, resp.Error
		case resp.Exit != nil:
			// The workload has exited; what it wrote is in the pipes (or still being
			// written by children it left behind, which a relay does not wait for).
			relays.wait()
			return resp.Exit, nil
		case resp.Started != "" && started != nil:
			started(resp.Started)
		}
	}
}

// handed are the descriptors sent for the workload's stdin, stdout and stderr, and
// which of them are child ends of relay pipes (closed once sent).
type handed struct {
	files [3]*os.File
	child [3]bool
}

func (h *handed) ints() []int {
	out := make([]int, 3)
	for i, f := range h.files {
		out[i] = int(f.Fd())
	}
	return out
}

func (h *handed) closeChildEnds() {
	for i, f := range h.files {
		if h.child[i] {
			f.Close()
		}
	}
}

// relaySet copies between relay pipes and the caller's own streams.
type relaySet struct {
	wg      sync.WaitGroup
	readers []*os.File // our ends of output pipes
	writers []*os.File // our end of the input pipe
}

func (r *relaySet) wait() {
	r.wg.Wait()
	for _, w := range r.writers {
		w.Close()
	}
}

func (r *relaySet) stop() {
	for _, f := range append(r.readers, r.writers...) {
		f.Close()
	}
}

// handOver decides per stream: a pipe goes to the workload as it is; anything else
// (a terminal, a file, a socket) is relayed through a new pipe, so the container
// never gets a descriptor it could reopen or use on the caller's terminal.
func handOver(s Stdio) (*handed, *relaySet, error) {
	h, r := &handed{}, &relaySet{}
	fail := func(err error) (*handed, *relaySet, error) {
		h.closeChildEnds()
		r.stop()
		return nil, nil, err
	}
	if s.Stdin == nil {
		null, err := os.Open(os.DevNull)
		if err != nil {
			return fail(err)
		}
		h.files[0], h.child[0] = null, true
	} else if isPipe(s.Stdin) {
		h.files[0] = s.Stdin
	} else {
		pr, pw, err := os.Pipe()
		if err != nil {
			return fail(err)
		}
		h.files[0], h.child[0] = pr, true
		r.writers = append(r.writers, pw)
		go func() { io.Copy(pw, s.Stdin); pw.Close() }()
	}
	for i, out := range []*os.File{s.Stdout, s.Stderr} {
		if isPipe(out) {
			h.files[i+1] = out
			continue
		}
		pr, pw, err := os.Pipe()
		if err != nil {
			return fail(err)
		}
		h.files[i+1], h.child[i+1] = pw, true
		r.readers = append(r.readers, pr)
		r.wg.Add(1)
		go func(dst *os.File) {
			defer r.wg.Done()
			io.Copy(dst, pr)
			pr.Close()
		}(out)
	}
	return h, r, nil
}

func isPipe(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeNamedPipe != 0
}

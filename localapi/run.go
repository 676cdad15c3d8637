package localapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/errdefs/pkg/errgrpc"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
)

// RunStreams connect a pool run to its caller. Stdin may be nil (no input).
type RunStreams struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	Signals        <-chan os.Signal
	// Steps, if set, receives the daemon's timed stages of the run (from the call's
	// trailer), once the run has ended.
	Steps func([]Step)
	// Started, if set, is called with the member's id when the daemon says the
	// workload runs.
	Started func(member string)
}

// RunStepsTrailer is the gRPC trailer key carrying a run's timed stages, as
// FormatSteps writes them: it travels beside the result, not in it, since it only
// explains where the time went.
const RunStepsTrailer = "tidepool-run-steps"

// Step is one timed stage of a run.
type Step struct {
	Name     string
	Duration time.Duration
}

// FormatSteps writes stages as name=milliseconds pairs, comma-separated.
func FormatSteps(steps []Step) string {
	var b strings.Builder
	for i, st := range steps {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(st.Name)
		b.WriteByte('=')
		b.WriteString(strconv.FormatFloat(float64(st.Duration.Microseconds())/1000, 'f', 3, 64))
	}
	return b.String()
}

// ParseSteps reads what FormatSteps wrote; malformed pairs are skipped, since the
// figures only inform.
func ParseSteps(s string) []Step {
	var out []Step
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		ms, err := strconv.ParseFloat(v, 64)
		if !ok || k == "" || err != nil {
			continue
		}
		out = append(out, Step{Name: k, Duration: time.Duration(ms * float64(time.Millisecond))})
	}
	return out
}

// Run claims a member of a pool and runs a command in it, relaying stdio and signals,
// until the workload exits.
func (c *Client) Run(ctx context.Context, start *apiv1.RunStart, s RunStreams) (*apiv1.RunExit, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := apiv1.NewPoolsClient(c.conn).Run(ctx)
	if err != nil {
		return nil, fmt.Errorf("tidepoold API at %s: %w", c.address, errgrpc.ToNative(err))
	}
	if err := stream.Send(&apiv1.RunRequest{Msg: &apiv1.RunRequest_Start{Start: start}}); err != nil {
		if !errors.Is(err, io.EOF) { // EOF: the daemon ended the call; Recv says why
			return nil, fmt.Errorf("tidepoold API at %s: %w", c.address, errgrpc.ToNative(err))
		}
	}
	sendErr := make(chan error, 1)
	msgs := make(chan *apiv1.RunRequest)
	go func() { // the one goroutine that sends after the start
		for m := range msgs {
			if err := stream.Send(m); err != nil {
				sendErr <- err
				return
			}
		}
	}()
	if s.Stdin != nil {
		go func() {
			buf := make([]byte, 32<<10)
			for {
				n, err := s.Stdin.Read(buf)
				if n > 0 {
					select {
					case msgs <- &apiv1.RunRequest{Msg: &apiv1.RunRequest_Stdin{Stdin: append([]byte(nil), buf[:n]...)}}:
					case <-ctx.Done():
						return
					}
				}
				if err != nil {
					select {
					case msgs <- &apiv1.RunRequest{Msg: &apiv1.RunRequest_StdinClose{StdinClose: true}}:
					case <-ctx.Done():
					}
					return
				}
			}
		}()
	}
	go func() {
		for {
			select {
			case sig := <-s.Signals:
				if n, ok := sig.(syscall.Signal); ok {
					select {
					case msgs <- &apiv1.RunRequest{Msg: &apiv1.RunRequest_Signal{Signal: int32(n)}}:
					case <-ctx.Done():
						return
					}
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	for {
		resp, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil, errors.New("tidepoold ended the run without an exit status")
			}
			return nil, errgrpc.ToNative(err)
		}
		switch m := resp.Msg.(type) {
		case *apiv1.RunResponse_Stdout:
			s.Stdout.Write(m.Stdout)
		case *apiv1.RunResponse_Stderr:
			s.Stderr.Write(m.Stderr)
		case *apiv1.RunResponse_Started:
			if s.Started != nil {
				s.Started(m.Started)
			}
		case *apiv1.RunResponse_Exit:
			if s.Steps != nil {
				// The trailer comes with the end of the stream, right after the exit.
				for {
					if _, err := stream.Recv(); err != nil {
						break
					}
				}
				s.Steps(ParseSteps(strings.Join(stream.Trailer().Get(RunStepsTrailer), ",")))
			}
			return m.Exit, nil
		}
	}
}

// ListPools reports the daemon's pools.
func (c *Client) ListPools(ctx context.Context) ([]*apiv1.PoolStatus, error) {
	r, err := apiv1.NewPoolsClient(c.conn).List(ctx, &apiv1.ListPoolsRequest{})
	if err != nil {
		return nil, fmt.Errorf("tidepoold API at %s: %w", c.address, errgrpc.ToNative(err))
	}
	return r.GetPools(), nil
}

// Pools returns the raw pools client, for the runtime shim's adoption calls.
func (c *Client) Pools() apiv1.PoolsClient { return apiv1.NewPoolsClient(c.conn) }

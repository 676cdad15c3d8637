package runwire

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"

	"github.com/tidepool-dev/tidepool/internal/peercred"
)

// Branch asks to branch a running container into new forks (`tidepool fork
// --container`): one request frame without descriptors, answered by one Branched or
// Error. It is on the run socket for the same reason as Start: the front binary
// serves it, so a branch costs a bare process start, not the full CLI's.
type Branch struct {
	Namespace  string            `json:"namespace,omitempty"`
	Container  string            `json:"container"`
	Count      int               `json:"count"`
	Label      string            `json:"label,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
	RequestID  string            `json:"request_id,omitempty"`
	TTLSeconds float64           `json:"ttl_seconds,omitempty"`
}

// Branched is tidepoold's answer to a Branch, and exactly what `tidepool fork
// --container --json` prints (both CLIs print this struct). Forks are the new forks'
// records, as `tidepool forks --json` shows them.
type Branched struct {
	Container   string            `json:"container"`
	Namespace   string            `json:"namespace"`
	SnapshotKey string            `json:"snapshot_key"`
	ForkID      string            `json:"fork_id"`
	Base        string            `json:"base"`
	Root        string            `json:"root"`
	Forks       []json.RawMessage `json:"forks"`
	Pause       string            `json:"pause"`
	PausedMs    float64           `json:"paused_ms"`
	WalkMs      float64           `json:"walk_ms"`
	TotalMs     float64           `json:"total_ms"`
	Files       int64             `json:"files"`
	LookupMs    float64           `json:"lookup_ms"`
	FreezeMs    float64           `json:"freeze_ms"`
	PublishMs   float64           `json:"publish_ms"`
	RecordMs    float64           `json:"record_ms"`
}

// ErrDial is a run socket that could not be reached (no tidepoold, or one too old to
// serve it): the request was not sent.
var ErrDial = errors.New("run socket unreachable")

// ErrNoAnswer is a request that was sent but not answered (tidepoold went away): it
// may have been carried out.
var ErrNoAnswer = errors.New("no answer from tidepoold")

// RequestBranch sends b to the tidepoold listening on addr and returns its answer. An
// *Error is tidepoold's refusal.
func RequestBranch(addr string, b Branch) (*Branched, error) {
	raw, err := net.Dial("unix", addr)
	if err != nil {
		return nil, fmt.Errorf("tidepoold run socket %s: %w: %w", addr, ErrDial, err)
	}
	c := raw.(*net.UnixConn)
	defer c.Close()
	if err := peercred.CheckConn(c); err != nil {
		return nil, fmt.Errorf("tidepoold run socket %s: %w", addr, err)
	}
	if err := WriteFrame(c, Request{Branch: &b}, nil); err != nil {
		return nil, fmt.Errorf("tidepoold run socket %s: send: %w: %w", addr, ErrDial, err)
	}
	var resp Response
	if _, err := ReadFrame(c, &resp, 0); err != nil {
		return nil, fmt.Errorf("tidepoold run socket %s: %w: %w", addr, ErrNoAnswer, err)
	}
	switch {
	case resp.Error != nil:
		return nil, resp.Error
	case resp.Branched == nil:
		return nil, fmt.Errorf("tidepoold run socket %s: %w: an answer with neither result nor error", addr, ErrMalformed)
	}
	return resp.Branched, nil
}

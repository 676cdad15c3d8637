// Package branchcmd is `tidepool fork --container` (branching a running container) as
// the front binary (cmd/tidepool) serves it, over tidepoold's run socket, and what both
// CLIs print for it. Branching is meant to be fast (tidepoold's part is a few
// milliseconds to a few tens); through the full CLI most of the caller's time was that
// binary's start-up, so the front serves it, linking the standard library, pflag and
// runwire only. The full CLI keeps the command (help, the gRPC API when the run socket
// cannot be reached, retries) and prints through Print, so the two cannot drift.
package branchcmd

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/tidepool-dev/tidepool/localapi/runwire"
)

// Options are fork's flags that go with --container, with the full CLI's names and
// defaults.
type Options struct {
	Container, Namespace, Label, RequestID string
	Count                                  int
	TTL                                    time.Duration
	LabelKVs                               []string
	JSON                                   bool
}

// Register adds the flags to f.
func (o *Options) Register(f *pflag.FlagSet) {
	f.StringVar(&o.Container, "container", "", "branch this running containerd container (its id) instead of forking a root")
	f.IntVar(&o.Count, "count", 1, "with --container: how many forks to make (labels get -1 ... -N)")
	f.StringVar(&o.Namespace, "namespace", DefaultNamespace(), "with --container: its containerd namespace (default $CONTAINERD_NAMESPACE or \"default\")")
	f.BoolVar(&o.JSON, "json", false, "with --container: print the answer as JSON")
	f.StringVar(&o.Label, "label", "", "a name to find the fork by (need not be unique)")
	f.DurationVar(&o.TTL, "ttl", 0, "remove the fork this long after its creation (0: never)")
	f.StringArrayVar(&o.LabelKVs, "label-kv", nil, "attach a key=value label (repeatable)")
	f.StringVar(&o.RequestID, "request-id", "", "make the create idempotent: a fork made earlier with this id is returned instead of a new one (default: a fresh id, also used by automatic retries)")
}

// DefaultNamespace is $CONTAINERD_NAMESPACE or "default".
func DefaultNamespace() string {
	if ns := os.Getenv("CONTAINERD_NAMESPACE"); ns != "" {
		return ns
	}
	return "default"
}

// ParseLabels turns KEY=VALUE entries into a map; nil for none.
func ParseLabels(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--label-kv %q: want KEY=VALUE: %w", kv, ErrInvalidArgument)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("--label-kv: key %q given twice: %w", k, ErrInvalidArgument)
		}
		out[k] = v
	}
	return out, nil
}

// ErrInvalidArgument is a bad flag value. containerd's errdefs reads it as its class
// of the same name (IsInvalidArgument), though this package does not link errdefs:
// the front binary links nothing of containerd's.
var ErrInvalidArgument error = invalidArgument{}

type invalidArgument struct{}

func (invalidArgument) Error() string     { return "invalid argument" }
func (invalidArgument) InvalidParameter() {}

// NewRequestID is a fresh request id, as forks.NewRequestID makes them.
func NewRequestID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}

// Request is the run socket's request for o.
func (o *Options) Request() (runwire.Branch, error) {
	if o.Count < 1 {
		return runwire.Branch{}, fmt.Errorf("--count %d: want at least 1: %w", o.Count, ErrInvalidArgument)
	}
	labels, err := ParseLabels(o.LabelKVs)
	if err != nil {
		return runwire.Branch{}, err
	}
	id := o.RequestID
	if id == "" {
		if id, err = NewRequestID(); err != nil {
			return runwire.Branch{}, err
		}
	}
	return runwire.Branch{Namespace: o.Namespace, Container: o.Container, Count: o.Count, Label: o.Label,
		Labels: labels, RequestID: id, TTLSeconds: o.TTL.Seconds()}, nil
}

// Run branches as o says on the tidepoold whose API socket is api and prints the
// answer to w. An error wrapping runwire.ErrDial means nothing was sent (no run socket
// to talk to): the caller may fall back to the full CLI.
func Run(o *Options, api string, w io.Writer) error {
	req, err := o.Request()
	if err != nil {
		return err
	}
	if api == "" {
		return fmt.Errorf("fork --container needs tidepoold: %w: none runs for this root", runwire.ErrDial)
	}
	res, err := runwire.RequestBranch(runwire.Address(api), req)
	if errors.Is(err, runwire.ErrNoAnswer) {
		return fmt.Errorf("%w: the forks may have been made; run again with --request-id %s to get them without making duplicates", err, req.RequestID)
	}
	if err != nil {
		return err
	}
	return Print(w, res, o.JSON)
}

// Print writes a branch's answer: one line per new fork, "ID ROOT LABEL" (no
// trailing space without a label), or with asJSON the whole answer, indented.
func Print(w io.Writer, b *runwire.Branched, asJSON bool) error {
	if asJSON {
		raw, err := json.Marshal(b)
		if err != nil {
			return err
		}
		var out bytes.Buffer
		if err := json.Indent(&out, raw, "", "  "); err != nil {
			return err
		}
		out.WriteByte('\n')
		_, err = w.Write(out.Bytes())
		return err
	}
	var out bytes.Buffer
	for _, raw := range b.Forks {
		var f struct {
			ID    string `json:"id"`
			Root  string `json:"root"`
			Label string `json:"label"`
		}
		if err := json.Unmarshal(raw, &f); err != nil {
			return fmt.Errorf("fork record in tidepoold's answer: %w", err)
		}
		out.WriteString(strings.TrimSpace(fmt.Sprintf("%s %s %s", f.ID, f.Root, f.Label)) + "\n")
	}
	_, err := w.Write(out.Bytes())
	return err
}

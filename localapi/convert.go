package localapi

import (
	"fmt"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// ForkToProto converts a fork record to its API form.
func ForkToProto(f *forks.Fork) *apiv1.Fork {
	p := &apiv1.Fork{
		Id: f.ID, Label: f.Label, Base: f.Base.String(), Root: f.Root.String(),
		Created: timestamppb.New(f.Created), Updated: timestamppb.New(f.Updated), Labels: f.Labels,
	}
	if f.TTL > 0 {
		p.Ttl = durationpb.New(time.Duration(f.TTL))
	}
	for _, r := range f.History {
		p.History = append(p.History, &apiv1.Revision{Root: r.Root.String(), Time: timestamppb.New(r.Time), Reason: r.Reason})
	}
	return p
}

// ForkFromProto converts an API fork to a record, checking its hashes.
func ForkFromProto(p *apiv1.Fork) (*forks.Fork, error) {
	f := &forks.Fork{ID: p.GetId(), Label: p.GetLabel(), Labels: p.GetLabels(),
		Created: p.GetCreated().AsTime(), Updated: p.GetUpdated().AsTime()}
	var err error
	if f.Base, err = ParseHash("base", p.GetBase()); err != nil {
		return nil, err
	}
	if f.Root, err = ParseHash("root", p.GetRoot()); err != nil {
		return nil, err
	}
	if p.GetTtl() != nil {
		f.TTL = forks.Duration(p.GetTtl().AsDuration())
	}
	for _, r := range p.GetHistory() {
		h, err := ParseHash("history root", r.GetRoot())
		if err != nil {
			return nil, err
		}
		f.History = append(f.History, forks.Revision{Root: h, Time: r.GetTime().AsTime(), Reason: r.GetReason()})
	}
	return f, nil
}

// ParseHash parses a hash field, as an invalid-argument error naming it.
func ParseHash(what, s string) (casstore.Hash, error) {
	h, err := casstore.ParseHash(s)
	if err != nil {
		return h, fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrInvalidArgument)
	}
	return h, nil
}

// parseOptionalHash reads a hash that may be left empty (meaning zero).
// ParseOptionalHash parses a hash field that may be empty (zero).
func ParseOptionalHash(what, s string) (casstore.Hash, error) {
	if s == "" {
		return casstore.Hash{}, nil
	}
	return ParseHash(what, s)
}

// MountsToProto converts containerd mounts to their API form.
func MountsToProto(ms []mount.Mount) []*apiv1.Mount {
	out := make([]*apiv1.Mount, 0, len(ms))
	for _, m := range ms {
		out = append(out, &apiv1.Mount{Type: m.Type, Source: m.Source, Target: m.Target, Options: m.Options})
	}
	return out
}

// MountsFromProto converts API mounts to containerd's type.
func MountsFromProto(ps []*apiv1.Mount) []mount.Mount {
	out := make([]mount.Mount, 0, len(ps))
	for _, p := range ps {
		out = append(out, mount.Mount{Type: p.GetType(), Source: p.GetSource(), Target: p.GetTarget(), Options: p.GetOptions()})
	}
	return out
}

package snapshotter

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/tidepool-dev/tidepool/internal/groupcommit"
)

// FailLabelWrites makes the next n label writes fail, as a full disk would.
func FailLabelWrites(s *Snapshotter, n int32) {
	var left atomic.Int32
	left.Store(n)
	next := s.labelWrites.Commit
	s.labelWrites = &groupcommit.Group[context.Context]{Commit: func(apply func(context.Context) error) error {
		if left.Add(-1) >= 0 {
			return errors.New("injected: no space left on device")
		}
		return next(apply)
	}}
}

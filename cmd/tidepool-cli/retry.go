package main

import (
	"context"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// lostRetries is how many times a fork-record call whose answer was lost (tidepoold
// went away mid-call) is retried, reconnecting first: to a restarted daemon, or to the
// database itself once the dead daemon has let go of it.
const (
	lostRetries = 5
	lostBackoff = 300 * time.Millisecond
)

// retryLost runs call against the fork service, retrying when the service became
// unavailable. call must be idempotent (a create with a request id, an advance that
// checks the fork's current root).
func (a *app) retryLost(ctx context.Context, call func(forks.Service) error) error {
	var err error
	for i := 0; ; i++ {
		var svc forks.Service
		if svc, err = a.openForks(ctx); err == nil {
			if err = call(svc); err == nil || !errdefs.IsUnavailable(err) {
				return err
			}
		}
		if i == lostRetries || !errdefs.IsUnavailable(err) || a.db != nil {
			return err
		}
		log.G(ctx).WithError(err).Warn("tidepoold did not answer; reconnecting and retrying")
		a.dropForks()
		select {
		case <-ctx.Done():
			return err
		case <-time.After(lostBackoff):
		}
	}
}

// dropForks forgets a daemon connection so the next openForks connects afresh (the
// old one is closed with the others when the command ends).
func (a *app) dropForks() {
	a.forks, a.api = nil, nil
}

package snapshotter

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// Remote is the shared bucket forks come from and commits go back to (see package
// remote). It is optional: without one, "remote:" forks and roots missing locally
// are refused.
type Remote interface {
	// ResolveRef reads a ref's current root.
	ResolveRef(ctx context.Context, name string) (casstore.Hash, error)
	// EnsureRoot makes root usable by a view here: at least its root tree local (a
	// FUSE view hydrates the rest lazily), or every object (a kernel view).
	EnsureRoot(ctx context.Context, root casstore.Hash) error
	// Publish uploads root and moves ref to it from expect by compare-and-swap. A
	// lost race keeps root as a conflict ref and returns an error for which
	// errdefs.IsConflict holds.
	Publish(ctx context.Context, ref string, expect, root casstore.Hash) error
}

// resolveRemoteFork makes a new fork record for "remote:NAME": based on the ref's
// current root, labelled with the ref so the commit goes back to it.
func (s *Snapshotter) resolveRemoteFork(ctx context.Context, name, key string) (string, casstore.Hash, bool, error) {
	if s.remote == nil {
		return "", casstore.Hash{}, false, fmt.Errorf("fork %s%s names a remote ref but no [remote] is configured: %w", binding.RemoteForkPrefix, name, errdefs.ErrInvalidArgument)
	}
	root, err := s.remote.ResolveRef(ctx, name)
	if err != nil {
		return "", root, false, err
	}
	if err := s.remote.EnsureRoot(ctx, root); err != nil {
		return "", root, false, err
	}
	if err := s.checkRoot(root); err != nil {
		return "", root, false, err
	}
	f, err := s.forks.Create(ctx, forks.CreateRequest{Base: root, Label: key, Labels: map[string]string{
		"tidepool.dev/snapshot": key, binding.ForkLabelRemoteRef: name, binding.ForkLabelRemoteRoot: root.String(),
	}})
	if err != nil {
		return "", root, false, fmt.Errorf("create fork record: %w", err)
	}
	log.G(ctx).WithField("ref", name).WithField("root", root.Short()).WithField("fork", f.ID).Info("fork of a remote ref")
	return f.ID, root, true, nil
}

// hydrateRoot fetches a root that is missing here from the remote, if there is one.
func (s *Snapshotter) hydrateRoot(ctx context.Context, root casstore.Hash) error {
	if s.remote == nil {
		return nil
	}
	if ok, err := s.store.Has(root); err != nil || ok {
		return err
	}
	return s.remote.EnsureRoot(ctx, root)
}

// publish pushes a committed root back to the remote ref its fork came from. A lost
// compare-and-swap is logged (the remote counts it) and not an error: the commit is
// kept in the fork and, in the bucket, as the conflict ref.
func (s *Snapshotter) publish(ctx context.Context, key, forkID string, base, root casstore.Hash) error {
	if s.remote == nil {
		return nil
	}
	f, err := s.forks.Get(ctx, forkID)
	if err != nil {
		return err
	}
	ref := f.Labels[binding.ForkLabelRemoteRef]
	if ref == "" {
		return nil
	}
	logger := log.G(ctx).WithField("key", key).WithField("fork", forkID).WithField("ref", ref).WithField("root", root.Short())
	err = s.remote.Publish(ctx, ref, base, root)
	switch {
	case err == nil:
		logger.Info("pushed the fork's commit to its remote ref")
		return nil
	case errdefs.IsConflict(err):
		logger.WithError(err).Warn("remote ref moved while the container ran; its commit was kept as a conflict ref")
		return nil
	default:
		return fmt.Errorf("push to remote ref %s: %w", ref, err)
	}
}

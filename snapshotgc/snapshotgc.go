// Package snapshotgc makes containerd collect removed tidepool snapshots promptly. A
// container's changes reach its fork when the snapshotter's Remove runs, and
// containerd calls Remove from its garbage collector, which ignores deletions that
// land while a collection is running: with many containers ending at once, a
// snapshot can wait for the next, unrelated, deletion. Watching containerd's
// /snapshot/remove events and asking for a synchronous collection (by deleting a
// throwaway lease) right after each burst closes that gap.
package snapshotgc

import (
	"context"
	"fmt"
	"slices"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/log"

	"github.com/tidepool-dev/tidepool/binding"
)

// debounce gathers a burst of removals into one collection.
const debounce = 50 * time.Millisecond

// Run watches containerd at address for removals of snapshotter's snapshots and
// triggers a collection after each burst, until ctx ends. It reconnects when
// containerd restarts.
func Run(ctx context.Context, address, snapshotter string) {
	for ctx.Err() == nil {
		if err := watch(ctx, address, snapshotter); err != nil && ctx.Err() == nil {
			log.G(ctx).WithError(err).Debug("snapshot gc watcher: containerd not reachable; retrying")
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func watch(ctx context.Context, address, snapshotter string) error {
	client, err := containerd.New(address)
	if err != nil {
		return err
	}
	defer client.Close()
	filter := fmt.Sprintf(`topic=="/snapshot/remove",event.snapshotter==%q`, snapshotter)
	events, errs := client.EventService().Subscribe(ctx, filter)
	var pending <-chan time.Time
	var namespace string
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errs:
			return err
		case e := <-events:
			if e.Namespace == binding.DoctorNamespace {
				continue // the doctor collects its own probe's garbage
			}
			namespace = e.Namespace
			if pending == nil {
				pending = time.After(debounce)
			}
		case <-pending:
			pending = nil
			if err := collect(namespaces.WithNamespace(ctx, namespace), client); err != nil {
				log.G(ctx).WithError(err).Warn("snapshot gc watcher: asking containerd to collect failed")
			}
		}
	}
}

// collect runs a synchronous garbage collection: deleting a lease with
// SynchronousDelete makes containerd collect before it answers. The lease goes in
// the namespace the removal happened in (collection is global anyway), unless that
// namespace is gone by now: a lease would create it again, resurrecting a namespace
// its owner just deleted. The check and the lease are two calls, so a namespace
// deleted between them is created again, empty; the watcher therefore ignores the
// one namespace it knows is deleted right after a removal (the doctor's probe).
func collect(ctx context.Context, client *containerd.Client) error {
	if ns, ok := namespaces.Namespace(ctx); ok {
		list, err := client.NamespaceService().List(ctx)
		if err != nil {
			return err
		}
		if !slices.Contains(list, ns) {
			return nil
		}
	}
	ls := client.LeasesService()
	l, err := ls.Create(ctx, leases.WithRandomID(), leases.WithExpiration(time.Minute))
	if err != nil {
		return err
	}
	return ls.Delete(ctx, l, leases.SynchronousDelete)
}

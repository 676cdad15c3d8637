package pool

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"
)

// TestMembersFrozenByCgroup: an idle member is frozen by its freezer cgroup, not
// paused through containerd, so a claim thaws it without a round trip to the shim
// and its teardown thaws the cgroup for the kill to land.
func TestMembersFrozenByCgroup(t *testing.T) {
	c, sn, cg := testController(t, Template{Target: 1})
	spec, _ := baseSpec()
	m := addMember(t, c, sn, spec, "img", time.Now())
	m.cgroup = "/tidepool-unit/" + m.id // under no real hierarchy: the direct write fails, the cgroup host thaws
	ctx := context.Background()
	if err := freezeMember(ctx, m); err != nil {
		t.Fatal(err)
	}
	if err := m.resume(ctx); err != nil {
		t.Fatal(err)
	}
	c.pools["node"][0].destroy(ctx, m)
	if got, want := cg.done(), []string{"freeze " + m.cgroup, "thaw " + m.cgroup, "thaw " + m.cgroup}; !reflect.DeepEqual(got, want) {
		t.Fatalf("cgroup operations %v, want %v", got, want)
	}
	// containerd only kills and deletes it (its resume after the kill is refused by a
	// running task, and harmless).
	if got, want := m.task.(*fakeTask).called(), []string{"kill 9", "resume", "delete"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("task calls %v, want %v", got, want)
	}
}

type freezeFails struct{ *fakeCgroups }

func (freezeFails) Freeze(string) error { return errors.New("no freezer") }

// TestMembersPausedWhenFreezeFails: without a freezer cgroup to use, members are
// paused and resumed through containerd.
func TestMembersPausedWhenFreezeFails(t *testing.T) {
	c, sn, cg := testController(t, Template{Target: 1})
	c.cgroups = freezeFails{cg}
	spec, _ := baseSpec()
	m := addMember(t, c, sn, spec, "img", time.Now())
	m.cgroup = "/tidepool-unit/" + m.id
	ctx := context.Background()
	if err := freezeMember(ctx, m); err != nil {
		t.Fatal(err)
	}
	if err := m.resume(ctx); err != nil {
		t.Fatal(err)
	}
	if got, want := m.task.(*fakeTask).called(), []string{"pause", "resume"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("task calls %v, want %v", got, want)
	}
	if ops := cg.done(); len(ops) != 0 {
		t.Fatalf("cgroup operations %v, want none", ops)
	}
}

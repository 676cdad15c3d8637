package pool

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/binding"
)

func TestTemplateShimGroups(t *testing.T) {
	tpl := Template{Name: "node", Image: "img", Target: 200}
	if err := tpl.Validate(); err != nil {
		t.Fatal(err)
	}
	if tpl.ShimGroupSize != DefaultShimGroupSize {
		t.Fatalf("default group size %d", tpl.ShimGroupSize)
	}
	groups := map[string]int{}
	for i := 0; i < 400; i++ {
		ann := tpl.annotations(fmt.Sprintf("node-%012x", i*7919))
		g := ann[binding.AnnotationShimGroup]
		if !strings.HasPrefix(g, "pool.node.") {
			t.Fatalf("member annotations %v", ann)
		}
		if _, ok := ann[binding.AnnotationShimGroupGrace]; ok {
			t.Fatalf("grace set without a template grace: %v", ann)
		}
		groups[g]++
	}
	// ceil(200/100) groups, each used.
	if len(groups) != 2 {
		t.Fatalf("groups %v, want 2", groups)
	}
	// A member's group is stable (its id decides).
	if a, b := tpl.annotations("node-1"), tpl.annotations("node-1"); a[binding.AnnotationShimGroup] != b[binding.AnnotationShimGroup] {
		t.Fatal("a member's group changed")
	}

	tpl.ShimGroupGrace = 30 * time.Second
	if g := tpl.annotations("node-1")[binding.AnnotationShimGroupGrace]; g != "30s" {
		t.Fatalf("grace annotation %q", g)
	}

	single := Template{Name: "solo", Image: "img", Target: 4, ShimGroupSize: 1}
	if err := single.Validate(); err != nil {
		t.Fatal(err)
	}
	if ann := single.annotations("solo-1"); ann[binding.AnnotationShimGroup] != "" || ann[binding.AnnotationRuntime] != "runc" {
		t.Fatalf("a shim per member: annotations %v", ann)
	}
	for _, bad := range []Template{
		{Name: "b", Image: "i", ShimGroupSize: -1},
		{Name: "b", Image: "i", ShimGroupGrace: -time.Second},
		{Name: "b", Image: "i", ShimGroupGrace: 2 * time.Hour},
	} {
		if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "shim_group") {
			t.Errorf("%+v: %v, want an error naming shim_group", bad, err)
		}
	}
}

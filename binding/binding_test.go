package binding

import (
	"errors"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

const root = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"

func TestParseLabels(t *testing.T) {
	spec, ok, err := Parse(map[string]string{LabelFork: root, LabelWorkdir: "/app/", LabelOwner: "1000:1000"}, LabelKeys, Defaults{})
	if err != nil || !ok {
		t.Fatalf("ok=%v err=%v", ok, err)
	}
	if spec.Workdir != "/app" || spec.Prefix() != "app" || spec.UID != 1000 || spec.GID != 1000 || spec.Fork != root {
		t.Fatalf("spec %+v", spec)
	}
	spec, ok, err = Parse(map[string]string{LabelFork: "0123456789abcdef"}, LabelKeys, Defaults{UID: 7, GID: 8})
	if err != nil || !ok || spec.Workdir != DefaultWorkdir || spec.UID != 7 || spec.GID != 8 {
		t.Fatalf("defaults: %+v %v %v", spec, ok, err)
	}
	if _, ok, err := Parse(map[string]string{"other": "x"}, LabelKeys, Defaults{}); ok || err != nil {
		t.Fatalf("no fork: ok=%v err=%v", ok, err)
	}
	spec, ok, err = Parse(map[string]string{LabelLateBind: "true", LabelWorkdir: "/srv/api"}, LabelKeys, Defaults{})
	if err != nil || !ok || !spec.LateBind || spec.Fork != "" || spec.Prefix() != "srv/api" {
		t.Fatalf("latebind: %+v %v %v", spec, ok, err)
	}
	spec, ok, err = Parse(map[string]string{LabelLateBind: "true", LabelSlot: "true"}, LabelKeys, Defaults{})
	if err != nil || !ok || !spec.LateBind || !spec.Slot {
		t.Fatalf("latebind with slot: %+v %v %v", spec, ok, err)
	}
}

func TestParseRefusesBadInput(t *testing.T) {
	cases := []struct {
		m   map[string]string
		key string
	}{
		{map[string]string{LabelFork: strings.Repeat("g", 64)}, LabelFork},
		{map[string]string{LabelFork: strings.ToUpper(root)}, LabelFork},
		{map[string]string{LabelFork: ""}, LabelFork},
		{map[string]string{LabelFork: root, LabelWorkdir: "app"}, LabelWorkdir},
		{map[string]string{LabelFork: root, LabelWorkdir: "/app/../../etc"}, LabelWorkdir},
		{map[string]string{LabelFork: root, LabelWorkdir: "/"}, LabelWorkdir},
		{map[string]string{LabelFork: root, LabelWorkdir: "/a\x00b"}, LabelWorkdir},
		{map[string]string{LabelFork: root, LabelOwner: "root"}, LabelOwner},
		{map[string]string{LabelFork: root, LabelOwner: "1000:-1"}, LabelOwner},
		{map[string]string{LabelFork: root, LabelOwner: "4294967295:0"}, LabelOwner},
		{map[string]string{LabelFork: root, LabelDiscard: "maybe"}, LabelDiscard},
		{map[string]string{LabelWorkdir: "/app"}, LabelWorkdir},
		{map[string]string{LabelFork: root, LabelLateBind: "true"}, LabelLateBind},
		{map[string]string{LabelFork: root, LabelSlot: "true"}, LabelSlot},
		{map[string]string{LabelLateBind: "true", LabelSlot: "yes please"}, LabelSlot},
	}
	for _, c := range cases {
		_, _, err := Parse(c.m, LabelKeys, Defaults{})
		if err == nil || !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.key) {
			t.Errorf("%v: err = %v, want invalid argument naming %s", c.m, err, c.key)
		}
	}
	_, _, err := Parse(map[string]string{AnnotationFork: root, AnnotationWorkdir: "rel"}, AnnotationKeys, Defaults{})
	if err == nil || !strings.Contains(err.Error(), AnnotationWorkdir) || !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("annotation error %v does not name %s", err, AnnotationWorkdir)
	}
}

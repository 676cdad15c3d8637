package pool

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestTemplateNamespaces: a template that names no namespace serves the
// controller's, else "default" (ctr's and nerdctl's), so the shipped configuration
// lets `ctr run` adopt; bad or repeated names are refused, naming the key.
func TestTemplateNamespaces(t *testing.T) {
	tm := Template{Name: "node", Image: "x"}
	if err := tm.Validate(); err != nil || !reflect.DeepEqual(tm.Namespaces, []string{"default"}) {
		t.Fatalf("default namespaces %q, %v", tm.Namespaces, err)
	}
	for _, bad := range [][]string{{"a/b"}, {"default", "default"}, {""}} {
		tm := Template{Name: "node", Image: "x", Namespaces: bad}
		if err := tm.Validate(); err == nil || !strings.Contains(err.Error(), "namespaces") {
			t.Errorf("namespaces %q: %v", bad, err)
		}
	}
	dir := t.TempDir()
	holderBin := filepath.Join(dir, "holder")
	if err := os.WriteFile(holderBin, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	c, err := NewController(Config{StateDir: filepath.Join(dir, "pools"), Holder: holderBin, Namespaces: []string{"k8s.io"},
		Templates: []Template{{Name: "a", Image: "x"}, {Name: "b", Image: "x", Namespaces: []string{"default", "k8s.io"}}}}, &fakeSnapshots{})
	if err != nil {
		t.Fatal(err)
	}
	if got := namespacesOf(c.pools["a"]); !reflect.DeepEqual(got, []string{"k8s.io"}) {
		t.Fatalf("pool a serves %q, want the controller's default", got)
	}
	if got := namespacesOf(c.pools["b"]); !reflect.DeepEqual(got, []string{"default", "k8s.io"}) {
		t.Fatalf("pool b serves %q", got)
	}
}

func namespacesOf(sets []*Pool) []string {
	var out []string
	for _, p := range sets {
		out = append(out, p.ns)
	}
	return out
}

// TestAdoptInContainerNamespace: a container adopts a member of the set in its own
// namespace (which it learns from its snapshot's key), whose snapshot has the same
// parent: the image as unpacked in that namespace. A container in a namespace the
// pool does not serve starts cold with reason "namespace" and takes nothing.
func TestAdoptInContainerNamespace(t *testing.T) {
	c, sn, _ := testController(t, Template{Namespaces: []string{"default", "k8s.io"}})
	mspec, rspec := baseSpec()
	def := addMemberTo(t, c.pools["node"][0], sn, mspec, "default/1/img", time.Now())
	k8s := addMemberTo(t, c.pools["node"][1], sn, mspec, "k8s.io/2/img", time.Now())
	defKey, k8sKey := def.snapKey, k8s.snapKey
	ctx := context.Background()
	ask := func(ns string, id string) (Adoption, error) {
		key := ns + "/50/" + id
		sn.mu.Lock()
		sn.infos[key] = snapshots.Info{Name: key, Parent: ns + "/" + map[string]string{"default": "1", "k8s.io": "2", "other": "3"}[ns] + "/img", Kind: snapshots.KindActive}
		sn.mu.Unlock()
		req := AdoptRequest{Pool: "node", ContainerID: id, Rootfs: []mount.Mount{{Type: "overlay", Source: key}}, Spec: clone(rspec), Runtime: "runc"}
		return c.Adopt(ctx, req)
	}
	a, err := ask("other", "c0")
	if err != nil || a.ColdReason != "namespace" {
		t.Fatalf("container in a namespace the pool does not serve: %+v, %v", a, err)
	}
	if n := testutil.ToFloat64(c.metrics.coldFallbacks.WithLabelValues("node", "namespace")); n != 1 {
		t.Fatalf("cold fallbacks for namespace: %v", n)
	}
	a, err = ask("k8s.io", "c1")
	if err != nil || a.ColdReason != "" || a.Member != k8s.id {
		t.Fatalf("container in k8s.io: %+v, %v; want member %s", a, err, k8s.id)
	}
	if len(c.pools["node"][0].idle) != 1 || c.pools["node"][0].idle[0] != def {
		t.Fatal("the default namespace's member was touched by a k8s.io container")
	}
	a, err = ask("default", "c2")
	if err != nil || a.ColdReason != "" || a.Member != def.id {
		t.Fatalf("container in default: %+v, %v; want member %s", a, err, def.id)
	}
	// Each set is its own: with the k8s.io member gone, k8s.io has none idle,
	// whatever default has.
	a, err = ask("k8s.io", "c3")
	if err != nil || a.ColdReason != "no_idle_member" {
		t.Fatalf("second k8s.io container: %+v, %v", a, err)
	}
	if n := testutil.ToFloat64(c.metrics.adoptions.WithLabelValues("node", "k8s.io")); n != 1 {
		t.Fatalf("adoptions in k8s.io: %v", n)
	}
	if want := [][2]string{{k8sKey, "k8s.io/50/c1"}, {defKey, "default/50/c2"}}; !reflect.DeepEqual(sn.rekeyed, want) {
		t.Fatalf("re-keyed %v, want %v", sn.rekeyed, want)
	}
}

// TestListSumsNamespaces: `tidepool pools` shows one line per pool, its members and
// sizes summed over the namespaces it serves; explicit claims take from the set with
// the most idle members.
func TestListSumsNamespaces(t *testing.T) {
	c, sn, _ := testController(t, Template{Namespaces: []string{"default", "k8s.io"}, Target: 2, Max: 3})
	mspec, _ := baseSpec()
	addMemberTo(t, c.pools["node"][0], sn, mspec, "img", time.Now())
	addMemberTo(t, c.pools["node"][1], sn, mspec, "img", time.Now())
	addMemberTo(t, c.pools["node"][1], sn, mspec, "img", time.Now())
	st := c.List()
	if len(st) != 1 || st[0].Idle != 3 || st[0].Target != 4 || st[0].Max != 6 || !reflect.DeepEqual(st[0].Namespaces, []string{"default", "k8s.io"}) {
		t.Fatalf("status %+v", st)
	}
	p, err := c.pool("node")
	if err != nil || p.ns != "k8s.io" {
		t.Fatalf("explicit claims take from %v, %v; want k8s.io (2 idle)", p, err)
	}
}

// TestTemplateRefusesKataFC: a kata-fc pool is refused at start, naming the runtime
// and the plan, rather than failing member after member.
func TestTemplateRefusesKataFC(t *testing.T) {
	tm := Template{Name: "vm", Image: "x", Runtime: "kata-fc"}
	if err := tm.Validate(); err == nil || !strings.Contains(err.Error(), `runtime "kata-fc"`) || !strings.Contains(err.Error(), "pools.md") {
		t.Fatalf("kata-fc template: %v", err)
	}
}

// TestControlSocketFits: a root and pool name whose member control sockets would not
// fit a unix socket address are refused at start, naming the pool.
func TestControlSocketFits(t *testing.T) {
	dir := t.TempDir()
	holderBin := filepath.Join(dir, "holder")
	if err := os.WriteFile(holderBin, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	long := filepath.Join(dir, strings.Repeat("r", 60), "pools")
	_, err := NewController(Config{StateDir: long, Holder: holderBin, Templates: []Template{{Name: strings.Repeat("n", 32), Image: "x"}}}, &fakeSnapshots{})
	if err == nil || !strings.Contains(err.Error(), "unix socket") || !strings.Contains(err.Error(), strings.Repeat("n", 32)) {
		t.Fatalf("long control socket paths: %v", err)
	}
	if _, err := NewController(Config{StateDir: filepath.Join(dir, "pools"), Holder: holderBin, Templates: []Template{{Name: "node", Image: "x"}}}, &fakeSnapshots{}); err != nil {
		t.Fatal(err)
	}
}

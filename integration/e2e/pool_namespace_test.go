package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/pool"
)

// projectSource is a small Node project with its own test suite (node:test), using
// lodash from the image's /app/node_modules.
var projectSource = map[string]string{
	"package.json":       `{"name":"slugs","version":"1.0.0","scripts":{"test":"node --test test/"}}` + "\n",
	"src/slug.js":        "const _ = require('lodash');\nmodule.exports = (s) => _.kebabCase(_.deburr(s));\n",
	"src/total.js":       "const _ = require('lodash');\nmodule.exports = (xs) => _.sumBy(xs, 'n');\n",
	"test/slug.test.js":  "const test = require('node:test');\nconst assert = require('node:assert');\nconst slug = require('../src/slug');\ntest('slug', () => { assert.strictEqual(slug('Crème Brûlée Recipe'), 'creme-brulee-recipe'); });\ntest('slug empty', () => { assert.strictEqual(slug(''), ''); });\n",
	"test/total.test.js": "const test = require('node:test');\nconst assert = require('node:assert');\nconst total = require('../src/total');\ntest('total', () => { assert.strictEqual(total([{n: 2}, {n: 40}]), 42); });\n",
	"README.md":          "# slugs\n",
}

// defaultNamespace is the namespace ctr and nerdctl use unless told otherwise.
const defaultNamespace = "default"

// defaultPoolStack starts a stack whose tidepoold has the shipped pool defaults: the
// template names only the pool and its image (holder and shim_config point at this
// stack's binaries and API socket; nothing else is set, so the pool serves the
// default namespace). Members and containers of the test run with runc state under
// the instance's directory (the harness cleans it whatever happens).
func defaultPoolStack(t *testing.T) (*stack.Stack, string) {
	t.Helper()
	node := imagebuild.NodeArchive(t)
	var shimCfg string
	s := stack.Start(t, stack.Options{Metrics: true, TidepooldConfig: func(s *stack.Stack) string {
		shimCfg = filepath.Join(s.Dir, "shim-default.toml")
		body := fmt.Sprintf("api_address = %q\n[runtimes.runc]\n  kind = \"runc\"\n  root = %q\n", s.APIAddress, filepath.Join(s.C.Dir, "runc"))
		if err := os.WriteFile(shimCfg, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("[pools]\nholder = %q\nshim_config = %q\n[[pools.template]]\nname = \"node\"\nimage = %q\n",
			filepath.Join(s.Bin, "tidepool-holder"), shimCfg, imagebuild.NodeRef)
	}})
	s.C.ImportImageInNamespace(t, defaultNamespace, node.Path, imagebuild.NodeRef, "tidepool")
	return s, shimCfg
}

func ctrIn(t testing.TB, s *stack.Stack, ns string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return s.C.CtrContext(ctx, ns, args...)
}

func mustCtrIn(t testing.TB, s *stack.Stack, ns string, args ...string) string {
	t.Helper()
	out, err := ctrIn(t, s, ns, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestPoolDefaultNamespaceAdoption: with the shipped default configuration, `ctr
// run --runtime io.containerd.tidepool.v1 --snapshotter tidepool --annotation
// dev.tidepool.pool=node` in ctr's default namespace adopts a warm member (no cold
// fallback, one adoption), runs a real project's test suite at the workdir, and what
// the suite writes lands on the fork. The members sit in that namespace, named and
// labelled as members. A container in a namespace the pool does not serve starts cold
// with the reason "namespace". Nothing is left behind.
func TestPoolDefaultNamespaceAdoption(t *testing.T) {
	s, shimCfg := defaultPoolStack(t)
	root := s.Ingest(t, writeTree(t, projectSource))
	waitPool(t, s, "node", 1) // the default template: target 1

	// The member is in the default namespace, visible to ctr, and reads as a member.
	members := strings.Fields(mustCtrIn(t, s, defaultNamespace, "container", "ls", "-q"))
	if len(members) != 1 || !strings.HasPrefix(members[0], pool.MemberIDPrefix+"node-") {
		t.Fatalf("containers in %s: %v, want one member named %snode-...", defaultNamespace, members, pool.MemberIDPrefix)
	}
	member := members[0]
	info := mustCtrIn(t, s, defaultNamespace, "container", "info", member)
	for _, l := range []string{`"dev.tidepool.pool": "node"`, `"dev.tidepool.member": "` + member + `"`} {
		if !strings.Contains(info, l) {
			t.Fatalf("member %s lacks the label %s:\n%s", member, l, info)
		}
	}

	cold := func() float64 { return s.Metric(t, "tidepool_pool_cold_fallbacks_total", `pool="node"`) }
	adopted := func() float64 {
		return s.Metric(t, "tidepool_pool_adoptions_total", `pool="node"`, `namespace="default"`)
	}
	cold0, adopted0 := cold(), adopted()

	// Exactly what a user types, in ctr's default namespace.
	flags := []string{"--runtime", "io.containerd.tidepool.v1", "--runtime-config-path", shimCfg, "--snapshotter", "tidepool",
		"--annotation", "dev.tidepool.pool=node", "--annotation", "dev.tidepool.fork=" + root, "--annotation", "dev.tidepool.workdir=/workspace",
		// The fork is at the default workdir; the image's packages are in /app.
		"--env", "NODE_PATH=/app/node_modules"}
	script := "cd /workspace && node --test --test-reporter=spec --test-reporter-destination=stdout " +
		"--test-reporter=tap --test-reporter-destination=/workspace/test-results.tap test/"
	out, err := ctrIn(t, s, defaultNamespace, append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, flags...),
		imagebuild.NodeRef, "default-ns-tests", "sh", "-c", script)...)
	if err != nil {
		t.Fatalf("the project's tests in an adopted member: %v\n%s\n%s", err, out, s.Daemon.LogTail(30))
	}
	if !strings.Contains(out, "pass 3") || !strings.Contains(out, "fail 0") {
		t.Fatalf("test output:\n%s", out)
	}
	if c := cold(); c != cold0 {
		t.Fatalf("cold fallbacks went from %v to %v: the container did not adopt\n%s", cold0, c, s.Daemon.LogTail(30))
	}
	if a := adopted(); a != adopted0+1 {
		t.Fatalf("adoptions in default went from %v to %v, want +1", adopted0, a)
	}
	// The member it adopted is gone (a used member never returns).
	waitFor(t, "the adopted member removed", func() string {
		if _, err := ctrIn(t, s, defaultNamespace, "container", "info", member); err == nil {
			return "member " + member + " still exists"
		}
		return ""
	})

	// The suite's report is the container's one change, on its fork.
	f := forkOfContainer(t, s, "default-ns-tests", root)
	if d := s.MustTidepool(t, "diff", root, f.ID); d != "A test-results.tap\n" {
		t.Fatalf("fork changes %q", d)
	}
	if tap := s.MustTidepool(t, "cat", f.ID, "test-results.tap"); !strings.Contains(tap, "# pass 3") || !strings.Contains(tap, "# fail 0") {
		t.Fatalf("test report on the fork:\n%s", tap)
	}

	// A namespace the pool does not serve (the image is there too): cold, with a
	// reason that says so, and the container still runs.
	waitPool(t, s, "node", 1)
	s.C.ImportImage(t, imagebuild.NodeArchive(t).Path, imagebuild.NodeRef, "tidepool")
	out = s.MustCtr(t, append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, flags...),
		imagebuild.NodeRef, "other-ns", "sh", "-c", "cd /workspace && node -e \"console.log(require('./src/slug')('A B'))\"")...)
	if out != "a-b\n" {
		t.Fatalf("cold container in %s printed %q", s.C.Namespace, out)
	}
	if n := s.Metric(t, "tidepool_pool_cold_fallbacks_total", `pool="node"`, `reason="namespace"`); n != 1 {
		t.Fatalf("cold fallbacks for namespace: %v, want 1", n)
	}
	if a := adopted(); a != adopted0+1 {
		t.Fatalf("adoptions went to %v", a)
	}

	waitPool(t, s, "node", 1)
	waitFor(t, "only the member left", func() string { return checkOnlyMembersIn(t, s, defaultNamespace, 1, "default-ns-tests", member) })
	if left := mustCtrIn(t, s, "", "container", "ls", "-q"); strings.TrimSpace(left) != "" {
		t.Fatalf("containers left in %s: %s", s.C.Namespace, left)
	}
}

// checkOnlyMembersIn returns "" when namespace ns holds exactly n containers, all
// members, with n active tidepool snapshots, the daemon exactly n views and mounts,
// and none of the gone containers (ids) keeps a cgroup; else what is off. (Other
// tests may use the host's /default cgroup, so only known ids are checked there.)
func checkOnlyMembersIn(t testing.TB, s *stack.Stack, ns string, n int, gone ...string) string {
	ctrs := strings.Fields(mustCtrIn(t, s, ns, "container", "ls", "-q"))
	if len(ctrs) != n {
		return fmt.Sprintf("%d containers in %s: %v", len(ctrs), ns, ctrs)
	}
	for _, id := range ctrs {
		if !strings.HasPrefix(id, pool.MemberIDPrefix) {
			return fmt.Sprintf("container %s in %s is not a member", id, ns)
		}
	}
	active := 0
	for _, line := range strings.Split(mustCtrIn(t, s, ns, "snapshot", "--snapshotter", "tidepool", "ls"), "\n") {
		if strings.Contains(line, "Active") {
			active++
		}
	}
	if active != n {
		return fmt.Sprintf("%d active snapshots in %s", active, ns)
	}
	views := viewDirs(s)
	mounts, _ := harness.MountsUnder(s.Root)
	if views != n || len(mounts) != n {
		return fmt.Sprintf("%d view and slot dirs, %d mounts under the root: %v", views, len(mounts), mounts)
	}
	for _, id := range gone {
		if cgs, _ := harness.CgroupDirs("/" + ns + "/" + id); len(cgs) > 0 {
			return fmt.Sprintf("cgroups of %s left: %v", id, cgs)
		}
	}
	return ""
}

package main

import (
	"strings"
	"testing"
)

// TestForkContainerFlags: the branch flags go with --container only, --container
// takes no ROOT, a bad count is refused, and without a daemon the error says so.
func TestForkContainerFlags(t *testing.T) {
	e := newEnv(t)
	root := e.tree(sample()).String()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"fork", root, "--count", "2"}, "go with --container"},
		{[]string{"fork", root, "--json"}, "go with --container"},
		{[]string{"fork", "--container", "c1", root}, "unknown command"},
		{[]string{"fork", "--container", "c1", "--count", "0"}, "--count 0"},
		{[]string{"fork", "--container", "c1"}, "needs tidepoold"},
	} {
		if got := e.fail(c.args...); !strings.Contains(got, c.want) {
			t.Errorf("tidepool %v: %q, want %q", c.args, got, c.want)
		}
	}
}

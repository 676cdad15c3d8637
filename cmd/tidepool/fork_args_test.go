package main

import (
	"strings"
	"testing"
)

func TestForkContainerArgs(t *testing.T) {
	for _, tc := range []struct {
		args  string
		front bool
	}{
		{"fork --container c", true},
		{"--root /r fork --container=c --count 3 --json", true},
		{"--api-address /a.sock fork --namespace n --container c --label-kv k=v", true},
		{"fork --container c --help", false},
		{"fork -h --container c", false},
		{"fork ROOT", false}, // a plain fork is the full CLI's
		{"--store /s fork --container c", false},
		{"forks", false},
		{"run --pool p -- fork --container c", false},
		{"", false},
	} {
		if got := forkContainerArgs(strings.Fields(tc.args)); got != tc.front {
			t.Errorf("%q: served by the front %v, want %v", tc.args, got, tc.front)
		}
	}
}

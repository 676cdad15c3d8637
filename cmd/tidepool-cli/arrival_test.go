package main

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/tidepool-dev/tidepool/internal/arrivalspool"
)

// spooled lists the roots recorded in state's arrival spool.
func spooled(t *testing.T, state string) []string {
	t.Helper()
	ents, err := os.ReadDir(arrivalspool.Dir(state))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// TestRootsRecordedWithoutDaemon: with no tidepoold running, every command that puts
// a root in the store, or makes or moves a fork to one, records it in the arrival
// spool for the next tidepoold to prepare: ingest, commit (over a root, and of a
// fork), fork.
func TestRootsRecordedWithoutDaemon(t *testing.T) {
	state := t.TempDir()
	base, upper, _ := commitTestSetup(t, state) // ingests base with the CLI
	want := []string{base}
	if got := spooled(t, state); !slices.Equal(got, want) {
		t.Fatalf("after an ingest the spool holds %v, want %v", got, want)
	}
	for _, name := range want {
		b, err := os.ReadFile(filepath.Join(arrivalspool.Dir(state), name))
		if err != nil || string(b) != filepath.Join(state, "cas") {
			t.Fatalf("record %s: %q, %v; want the store's path", name, b, err)
		}
	}
	recs, _, err := arrivalspool.Take(state, filepath.Join(state, "cas"), 10)
	if err != nil || len(recs) != 1 {
		t.Fatalf("Take: %v, %v", recs, err)
	}

	out, _, err := ingestTestCLI(t, state, "commit", "--base", base, "--upper", upper, "--prefix", "app")
	if err != nil {
		t.Fatal(err)
	}
	if got := spooled(t, state); !slices.Equal(got, []string{ingestLastRoot(t, out).String()}) {
		t.Fatalf("after a commit over a root the spool holds %v", got)
	}
	arrivalspool.Take(state, filepath.Join(state, "cas"), 10)

	if _, _, err := ingestTestCLI(t, state, "fork", base, "--label", "dev"); err != nil {
		t.Fatal(err)
	}
	if got := spooled(t, state); !slices.Equal(got, []string{base}) {
		t.Fatalf("after a fork the spool holds %v, want %s", got, base)
	}
	arrivalspool.Take(state, filepath.Join(state, "cas"), 10)

	upper2 := t.TempDir()
	ingestTestWrite(t, filepath.Join(upper2, "app", "more.go"), "package main // more\n")
	out, _, err = ingestTestCLI(t, state, "commit", "--base", "dev", "--upper", upper2, "--prefix", "app")
	if err != nil {
		t.Fatal(err)
	}
	next := ingestLastRoot(t, out).String()
	if got := spooled(t, state); !slices.Equal(got, []string{next}) {
		t.Fatalf("after a fork's commit the spool holds %v, want %s", got, next)
	}
	if next == base {
		t.Fatal("the fork's commit printed its base")
	}
}

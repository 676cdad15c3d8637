package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore/forks"
)

// commitTestSetup ingests a base tree and makes an upper dir that adds a file under
// app/ and one outside it; it returns the base root line and the expected new root.
func commitTestSetup(t *testing.T, state string) (base, upper, want string) {
	t.Helper()
	src := filepath.Join(t.TempDir(), "src")
	ingestTestWrite(t, filepath.Join(src, "main.go"), "package main\n")
	ingestTestWrite(t, filepath.Join(src, "lib", "lib.go"), "package lib\n")
	out, _, err := ingestTestCLI(t, state, "ingest", src)
	if err != nil {
		t.Fatal(err)
	}
	base = ingestLastRoot(t, out).String()

	upper = t.TempDir()
	ingestTestWrite(t, filepath.Join(upper, "app", "lib", "new.go"), "package lib // new\n")
	ingestTestWrite(t, filepath.Join(upper, "etc", "hostname"), "outside the prefix\n")

	merged := filepath.Join(t.TempDir(), "merged")
	ingestTestWrite(t, filepath.Join(merged, "main.go"), "package main\n")
	ingestTestWrite(t, filepath.Join(merged, "lib", "lib.go"), "package lib\n")
	ingestTestWrite(t, filepath.Join(merged, "lib", "new.go"), "package lib // new\n")
	return base, upper, ingestTestDir(t, state, merged).String()
}

func TestCommitCommandOverRoot(t *testing.T) {
	state := t.TempDir()
	base, upper, want := commitTestSetup(t, state)
	out, errOut, err := ingestTestCLI(t, state, "commit", "--base", base, "--upper", upper, "--prefix", "app")
	if err != nil {
		t.Fatal(err)
	}
	if got := ingestLastRoot(t, out).String(); got != want {
		t.Fatalf("commit printed %s, want %s (the merged tree's root)", got, want)
	}
	if !strings.Contains(errOut, "committed") {
		t.Errorf("stderr %q lacks the summary", errOut)
	}
}

func TestCommitCommandAdvancesFork(t *testing.T) {
	state := t.TempDir()
	base, upper, want := commitTestSetup(t, state)
	db, err := forks.OpenDB(filepath.Join(state, "forks.db"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	baseHash := ingestLastRoot(t, base+"\n")
	f, err := db.Create(t.Context(), forks.CreateRequest{Base: baseHash, Label: "dev"})
	if err != nil {
		t.Fatal(err)
	}
	db.Close()

	out, errOut, err := ingestTestCLI(t, state, "commit", "--base", "dev", "--upper", upper, "--prefix", "app")
	if err != nil {
		t.Fatal(err)
	}
	if got := ingestLastRoot(t, out).String(); got != want {
		t.Fatalf("commit printed %s, want %s", got, want)
	}
	if !strings.Contains(errOut, "fork "+f.ID) {
		t.Errorf("stderr %q does not report the fork", errOut)
	}
	db, err = forks.OpenDB(filepath.Join(state, "forks.db"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	got, err := db.Get(t.Context(), f.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Root.String() != want || len(got.History) != 1 || got.History[0].Root != baseHash || got.History[0].Reason != "commit" {
		t.Fatalf("fork after commit: root %s, history %+v; want root %s with the base in its history", got.Root, got.History, want)
	}
}

func TestCommitCommandValidates(t *testing.T) {
	state := t.TempDir()
	base, upper, _ := commitTestSetup(t, state)
	cases := map[string][]string{
		`".."`:        {"--prefix", "../app"},
		"relative":    {"--prefix", "/app"},
		"not clean":   {"--prefix", "app/./x"},
		"upper":       {"--upper", ""},
		"no such":     {"--upper", filepath.Join(upper, "missing")},
		"fork \"zz\"": {"--base", "zz"},
	}
	for want, extra := range cases {
		args := map[string]string{"--base": base, "--upper": upper, "--prefix": "app"}
		args[extra[0]] = extra[1]
		argv := []string{"commit"}
		for k, v := range args {
			if v != "" {
				argv = append(argv, k, v)
			}
		}
		out, _, err := ingestTestCLI(t, state, argv...)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("commit %v: err = %v, want one mentioning %s", argv[1:], err, want)
		}
		if out != "" {
			t.Errorf("commit %v printed %q after a failure", argv[1:], out)
		}
	}
}

package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/remote"
	"github.com/tidepool-dev/tidepool/remote/s3test"
)

// TestRemoteCommands drives push, pull, refs and ref rm between two roots through a
// real MinIO, including a lost compare-and-swap and wrong credentials.
func TestRemoteCommands(t *testing.T) {
	srv := s3test.Start(t)
	url := "s3://" + srv.Bucket + "/cli"
	a, b := newEnv(t), newEnv(t)
	r0 := a.tree(map[string]leaf{"README.md": file("hi\n"), "src/main.go": file("package main\n")})
	r1 := a.tree(map[string]leaf{"README.md": file("hi\n"), "src/main.go": file("package main // A\n")})
	r2 := a.tree(map[string]leaf{"README.md": file("hi\n"), "src/main.go": file("package main // B\n")})

	if msg := a.fail("push", r0.String()); !strings.Contains(msg, "--remote") {
		t.Fatalf("push without a remote: %q", msg)
	}
	if out := a.ok("--remote", url, "push", r0.String(), "--ref", "main"); out != r0.String()+"\n" {
		t.Fatalf("push printed %q", out)
	}
	// B pulls main as a fork: labelled with the ref and its root.
	id := strings.TrimSpace(b.ok("--remote", url, "pull", "main", "--fork"))
	var list []forks.Fork
	if err := json.Unmarshal([]byte(b.ok("forks", "--json")), &list); err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].ID != id || list[0].Root != r0 || list[0].Label != "main" ||
		list[0].Labels[binding.ForkLabelRemoteRef] != "main" || list[0].Labels[binding.ForkLabelRemoteRoot] != r0.String() {
		t.Fatalf("fork made by pull --fork: %+v", list)
	}
	if got := b.ok("cat", id, "src/main.go"); got != "package main\n" {
		t.Fatalf("pulled file: %q", got)
	}

	// A advances main; a push expecting the old root loses and leaves a conflict ref.
	a.ok("--remote", url, "push", r1.String(), "--ref", "main", "--expect", r0.String())
	out, errOut, code := a.run("--remote", url, "push", r2.String(), "--ref", "main", "--expect", r0.String())
	conflict := remote.ConflictName("main", r2)
	if code == 0 || out != conflict+"\n" || !strings.Contains(errOut, conflict) || strings.Count(errOut, "\n") != 1 {
		t.Fatalf("lost push: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	var refs []remote.Ref
	if err := json.Unmarshal([]byte(b.ok("--remote", url, "refs", "--json")), &refs); err != nil {
		t.Fatal(err)
	}
	if len(refs) != 2 || refs[0].Name != "main" || refs[0].Root != r1 || refs[1].Name != conflict || refs[1].Root != r2 || refs[1].Conflict != "main" {
		t.Fatalf("refs: %+v", refs)
	}
	if got := b.ok("--remote", url, "pull", conflict); got != r2.String()+"\n" {
		t.Fatalf("pull of the conflict ref printed %q", got)
	}
	b.ok("fsck")
	if table := b.ok("--remote", url, "refs"); !strings.Contains(table, conflict+"  "+r2.String()+"  main") {
		t.Fatalf("refs table:\n%s", table)
	}
	b.ok("--remote", url, "ref", "rm", conflict)
	if msg := b.fail("--remote", url, "ref", "rm", conflict); !strings.Contains(msg, "not found") {
		t.Fatalf("second ref rm: %q", msg)
	}
	if msg := b.fail("--remote", url, "pull", "../etc"); !strings.Contains(msg, "ref name") {
		t.Fatalf("bad ref name: %q", msg)
	}

	t.Setenv("AWS_SECRET_ACCESS_KEY", "wrong")
	msg := b.fail("--remote", url, "refs")
	if !strings.Contains(msg, "access denied") || !strings.Contains(msg, "AWS_SECRET_ACCESS_KEY") {
		t.Fatalf("wrong credentials: %q", msg)
	}
	t.Logf("wrong credentials: %s", msg)
}

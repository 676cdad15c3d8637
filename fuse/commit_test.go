package fuse

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// TestCommitOfEditsOverViewEqualsIngest edits a fork through an overlay whose top
// lower is the view (as the owner, not root), commits the upper dir with ingest.Upper
// and checks the result is exactly the root of ingesting the merged directory.
func TestCommitOfEditsOverViewEqualsIngest(t *testing.T) {
	requireRoot(t)
	ctx := t.Context()
	s := newStore(t)
	base, _, err := ingest.Dir(ctx, s, writeFixture(t), ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	image := sharedDir(t) // an image with no /app of its own
	if err := os.MkdirAll(filepath.Join(image, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	v := mount(t, s, base, Options{Prefix: "app", UID: testUID, GID: testGID})
	merged, upper := mountOverlay(t, v.Dir(), image)
	app := filepath.Join(merged, "app")

	script := `set -e
echo new > new.txt
echo edited >> src/main.go
rm README.md
rm -r src/util
mkdir -p newdir/deeper && echo x > newdir/deeper/f
ln -s ../README.md newdir/link
mv bin/run.sh bin/run2.sh
chmod -x bin/run2.sh
chmod +x src/main.go
rm big.bin && echo small > big.bin
`
	if out, err := runAs(t, testUID, testGID, "sh", "-c", "cd "+app+" && "+script); err != nil {
		t.Fatalf("edits as owner: %v\n%s", err, out)
	}
	got, err := ingest.Upper(ctx, s, base, upper, "app", ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	want, _, err := ingest.Dir(ctx, s, app, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("commit of the upper = %s, ingest of the merged dir = %s", got, want)
	}
	if got == base {
		t.Fatal("edits changed nothing")
	}
}

package shim

import (
	"bytes"
	"os"
	"reflect"
	"testing"

	"github.com/pelletier/go-toml/v2"
)

// The shim has no printer of its defaults: contrib/shim.toml is prose around the
// routing table (what each kind and key means, a commented alternative) that a
// printer from struct tags would lose. This test keeps its settings equal to
// DefaultConfig instead: every key it sets is a real key, and it sets exactly the
// defaults.
func TestContribShimConfigIsTheDefault(t *testing.T) {
	b, err := os.ReadFile("../contrib/shim.toml")
	if err != nil {
		t.Fatal(err)
	}
	var file Config
	dec := toml.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&file); err != nil {
		t.Fatalf("contrib/shim.toml: %v", err)
	}
	if want := DefaultConfig(); !reflect.DeepEqual(&file, want) {
		t.Fatalf("contrib/shim.toml no longer shows the shim's defaults (shim.DefaultConfig): edit the file to match.\n"+
			"file:    %+v\ndefault: %+v", file, *want)
	}
}

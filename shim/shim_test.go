package shim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types/runc/options"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"
)

func TestRoutes(t *testing.T) {
	cfg := DefaultConfig()
	if name, r, err := cfg.RouteFor(nil); err != nil || name != "runc" || r.Kind != KindRunc {
		t.Fatalf("default route: %s %+v %v", name, r, err)
	}
	if _, r, err := cfg.RouteFor(map[string]string{AnnotationRuntime: "runsc"}); err != nil || r.BinaryName != "runsc" || !r.CreateNetns {
		t.Fatalf("runsc route: %+v %v", r, err)
	}
	if _, r, err := cfg.RouteFor(map[string]string{AnnotationRuntime: "kata-fc"}); err != nil || r.Kind != KindShim || r.Protocol != ProtocolLegacy {
		t.Fatalf("kata-fc route: %+v %v", r, err)
	}
	_, _, err := cfg.RouteFor(map[string]string{AnnotationRuntime: "qemu"})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "kata-fc, runc, runsc") || !strings.Contains(err.Error(), AnnotationRuntime) {
		t.Fatalf("unknown route: %v", err)
	}
}

func TestParseConfigMergesAndValidates(t *testing.T) {
	cfg, err := ParseConfig([]byte("api_address = '/x.sock'\nConfigPath = ''\n[runtimes.crun]\nkind = 'runc'\nbinary_name = 'crun'\n"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.APIAddress != "/x.sock" || cfg.Runtimes["crun"].BinaryName != "crun" || cfg.Runtimes["runc"].Kind != KindRunc {
		t.Fatalf("merged config %+v", cfg)
	}
	for _, bad := range []string{
		"[runtimes.x]\nkind = 'vm'\n",
		"[runtimes.x]\nkind = 'shim'\nprotocol = 'bootstrap'\n",
		"[runtimes.x]\nkind = 'shim'\nshim = 'a'\nprotocol = 'carrier-pigeon'\n",
		"default_runtime = 'nothing'\n",
		"api_address = [\n",
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func TestLoadConfigSources(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "shim.toml")
	os.WriteFile(file, []byte("api_address = '/from-path.sock'\n"), 0o644)
	any, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: file})
	if cfg, err := LoadConfig(any); err != nil || cfg.APIAddress != "/from-path.sock" {
		t.Fatalf("ConfigPath: %+v %v", cfg, err)
	}
	any, _ = typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigBody: []byte("api_address = '/from-body.sock'\n")})
	if cfg, err := LoadConfig(any); err != nil || cfg.APIAddress != "/from-body.sock" {
		t.Fatalf("ConfigBody: %+v %v", cfg, err)
	}
	env := filepath.Join(dir, "env.toml")
	os.WriteFile(env, []byte("api_address = '/from-env.sock'\n"), 0o644)
	t.Setenv(ConfigEnv, env)
	if cfg, err := LoadConfig(nil); err != nil || cfg.APIAddress != "/from-env.sock" {
		t.Fatalf("env: %+v %v", cfg, err)
	}
}

// CRI sends runtimeoptions for non-runc runtime types; the runc service asserts its
// own options type unchecked, so they must be replaced, keeping runc options' fields.
func TestRuncOptionsNormalised(t *testing.T) {
	cri, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigBody: []byte("x = 1")})
	out, err := runcOptions(cri, Route{Kind: KindRunc, BinaryName: "runsc"})
	if err != nil {
		t.Fatal(err)
	}
	v, err := typeurl.UnmarshalAny(out)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := v.(*options.Options); !ok || o.BinaryName != "runsc" {
		t.Fatalf("normalised options %#v", v)
	}
	in, _ := typeurl.MarshalAnyToProto(&options.Options{SystemdCgroup: true, Root: "/r"})
	out, _ = runcOptions(in, Route{Kind: KindRunc})
	v, _ = typeurl.UnmarshalAny(out)
	if o := v.(*options.Options); !o.SystemdCgroup || o.Root != "/r" {
		t.Fatalf("runc options lost fields: %#v", o)
	}
	if out, _ := runcOptions(nil, Route{Kind: KindRunc}); out == nil {
		t.Fatal("nil options not normalised")
	}
}

func TestParseStartResponse(t *testing.T) {
	b, _ := proto.Marshal(&bootapi.BootstrapResult{Version: 3, Protocol: "ttrpc", Address: "unix:///run/s/abc"})
	if r, err := parseStartResponse(b); err != nil || r.Address != "unix:///run/s/abc" || r.Version != 3 {
		t.Fatalf("bootstrap result: %+v %v", r, err)
	}
	j, _ := json.Marshal(map[string]any{"version": 2, "protocol": "grpc", "address": "unix:///run/s/def"})
	if r, err := parseStartResponse(j); err != nil || r.Address != "unix:///run/s/def" || r.Protocol != "grpc" {
		t.Fatalf("json result: %+v %v", r, err)
	}
	// Kata's Go shim (containerd 1.7 shim library) prints a plain address.
	if r, err := parseStartResponse([]byte("unix:///run/containerd/s/0123456789abcdef\n")); err != nil ||
		r.Address != "unix:///run/containerd/s/0123456789abcdef" || r.Version != 2 || r.Protocol != "ttrpc" {
		t.Fatalf("plain address: %+v %v", r, err)
	}
	if _, err := parseStartResponse([]byte("  \n")); err == nil {
		t.Fatal("empty output accepted")
	}
}

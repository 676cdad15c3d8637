package shim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"time"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	shimapi "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/pkg/shim"
	"google.golang.org/protobuf/proto"
)

var lookPath = exec.LookPath

// delegateCommand runs the delegate shim with this invocation's arguments (the
// -namespace/-id/-address flags and the action), in the bundle, with the route's
// extra environment.
func delegateCommand(ctx context.Context, rec routeRecord) *exec.Cmd {
	cmd := exec.CommandContext(ctx, rec.ShimPath, os.Args[1:]...)
	cmd.Dir, _ = os.Getwd()
	cmd.Env = append(os.Environ(), rec.Route.Env...)
	cmd.Stderr = os.Stderr
	return cmd
}

// startDelegate runs the delegate's start and turns whatever it prints into a
// BootstrapResult, as containerd would have.
func startDelegate(ctx context.Context, rec routeRecord, params *bootapi.BootstrapParams) (*bootapi.BootstrapResult, error) {
	cmd := delegateCommand(ctx, rec)
	switch rec.Route.Protocol {
	case ProtocolBootstrap:
		in, err := proto.Marshal(params)
		if err != nil {
			return nil, err
		}
		cmd.Stdin = bytes.NewReader(in)
	case ProtocolLegacy:
		if opts := runtimeOptions(params); opts != nil {
			in, err := proto.Marshal(opts)
			if err != nil {
				return nil, err
			}
			cmd.Stdin = bytes.NewReader(in)
		}
	}
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("runtime %q: %s start: %w", rec.Name, rec.ShimPath, err)
	}
	res, err := parseStartResponse(out)
	if err != nil {
		return nil, fmt.Errorf("runtime %q: %s start: %w", rec.Name, rec.ShimPath, err)
	}
	return res, nil
}

// parseStartResponse accepts the three forms a shim's start may print: a
// BootstrapResult (containerd >= 2.3 shims), JSON, or a plain address (older shims).
func parseStartResponse(out []byte) (*bootapi.BootstrapResult, error) {
	var res bootapi.BootstrapResult
	if err := proto.Unmarshal(out, &res); err == nil && res.GetAddress() != "" && res.GetVersion() >= 2 {
		return &res, nil
	}
	trimmed := bytes.TrimSpace(out)
	if len(trimmed) == 0 {
		return nil, fmt.Errorf("printed no address")
	}
	var j bootapi.BootstrapResult
	if err := json.Unmarshal(trimmed, &j); err == nil && j.GetVersion() >= 2 && j.GetAddress() != "" {
		return &j, nil
	}
	return &bootapi.BootstrapResult{Version: 2, Protocol: "ttrpc", Address: string(trimmed)}, nil
}

// deleteDelegate forwards delete and reads the DeleteResponse it prints.
func deleteDelegate(ctx context.Context, rec routeRecord) (shim.StopStatus, error) {
	out, err := delegateCommand(ctx, rec).Output()
	if err != nil {
		return shim.StopStatus{}, fmt.Errorf("runtime %q: %s delete: %w", rec.Name, rec.ShimPath, err)
	}
	var resp shimapi.DeleteResponse
	if err := proto.Unmarshal(out, &resp); err != nil {
		return shim.StopStatus{}, fmt.Errorf("runtime %q: %s delete: unreadable response: %w", rec.Name, rec.ShimPath, err)
	}
	st := shim.StopStatus{Pid: int(resp.GetPid()), ExitStatus: int(resp.GetExitStatus()), ExitedAt: time.Unix(0, 0)}
	if resp.GetExitedAt() != nil {
		st.ExitedAt = resp.GetExitedAt().AsTime()
	}
	return st, nil
}

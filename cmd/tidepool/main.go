// Command tidepool is the CLI's front: it serves `tidepool run` and `tidepool fork
// --container` itself and hands every other command line to the full CLI,
// tidepool-cli, installed beside it.
//
// Why two binaries: a warm `tidepool run` is a ~20 ms claim inside tidepoold, and
// the full CLI (cobra, containerd's client, the store, the S3 client, Prometheus)
// took about 35 ms just to start. This front links the standard library, pflag and
// the run socket's protocol only, so it starts like a bare Go binary. Anything it does
// not recognise (another command, help, a global flag only the full CLI knows) goes
// to tidepool-cli with the same arguments (execve: same pid, stdio and signals), so
// both behave as one command.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/tidepool-dev/tidepool/internal/branchcmd"
	"github.com/tidepool-dev/tidepool/internal/runcmd"
	"github.com/tidepool-dev/tidepool/localapi/runwire"
)

// mainStarted is when this package was initialized, for --timings.
var mainStarted = time.Now()

// FullCLI is the full CLI's binary name, looked up beside this one, then on PATH.
const FullCLI = "tidepool-cli"

// DefaultRoot is where Tidepool keeps its state unless told otherwise (the full CLI's
// default, which its tests hold equal).
const DefaultRoot = "/var/lib/tidepool"

func main() {
	if rest, ok := runArgs(os.Args[1:]); ok {
		os.Exit(run(rest))
	}
	if forkContainerArgs(os.Args[1:]) {
		os.Exit(forkContainer(os.Args[1:]))
	}
	execFull()
}

// runArgs says whether the command line is a `run` the front serves: global flags it
// knows (--root, --api-address, --log-level) then "run"; help goes to the full CLI.
func runArgs(args []string) ([]string, bool) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "run":
			for _, r := range args[i+1:] {
				if r == "--" {
					break
				}
				if r == "-h" || r == "--help" {
					return nil, false
				}
			}
			return args, true
		case a == "--root" || a == "--api-address" || a == "--log-level":
			i++ // its value
		case len(a) > 2 && (hasPrefix(a, "--root=") || hasPrefix(a, "--api-address=") || hasPrefix(a, "--log-level=")):
		default:
			return nil, false
		}
	}
	return nil, false
}

// forkContainerArgs says whether the command line is a `fork --container` the front
// serves: global flags it knows, then "fork" with --container; help goes to the full CLI.
func forkContainerArgs(args []string) bool {
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "fork":
			container := false
			for _, r := range args[i+1:] {
				switch {
				case r == "-h" || r == "--help":
					return false
				case r == "--container" || hasPrefix(r, "--container="):
					container = true
				}
			}
			return container
		case a == "--root" || a == "--api-address" || a == "--log-level":
			i++ // its value
		case len(a) > 2 && (hasPrefix(a, "--root=") || hasPrefix(a, "--api-address=") || hasPrefix(a, "--log-level=")):
		default:
			return false
		}
	}
	return false
}

func hasPrefix(s, p string) bool { return len(s) >= len(p) && s[:len(p)] == p }

// run parses the whole command line (global flags may also follow "run", as with the
// full CLI) and runs it; it returns the exit status.
func run(args []string) int {
	f := pflag.NewFlagSet("tidepool run", pflag.ContinueOnError)
	f.SetOutput(io.Discard)
	root := f.String("root", DefaultRoot, "Tidepool root directory")
	api := f.String("api-address", "", "tidepoold API socket")
	f.String("log-level", "warn", "log level on stderr")
	var o runcmd.Options
	o.Register(f)
	f.Usage = func() {}
	if err := f.Parse(args); err != nil {
		// A flag only the full CLI knows (--store, the walk limits, ...), or a
		// mistake: the full CLI parses it and says which.
		execFull()
	}
	rest := f.Args()[1:] // after "run"
	addr := *api
	if addr == "" {
		addr = runcmd.APIAddress(*root)
	}
	err := runcmd.Run(&o, *root, addr, rest, mainStarted)
	var exit runcmd.ExitError
	switch {
	case errors.As(err, &exit):
		return exit.Status
	case err != nil:
		fmt.Fprintf(os.Stderr, "tidepool: %v\n", err)
		return 1
	}
	return 0
}

// forkContainer serves `tidepool fork --container ...` over tidepoold's run socket
// (package branchcmd); anything it cannot serve goes to the full CLI: a flag it does
// not know, a positional argument, or no run socket to talk to (the full CLI then uses
// the API, or says why there is none).
func forkContainer(args []string) int {
	f := pflag.NewFlagSet("tidepool fork", pflag.ContinueOnError)
	f.SetOutput(io.Discard)
	f.Usage = func() {}
	root := f.String("root", DefaultRoot, "Tidepool root directory")
	api := f.String("api-address", "", "tidepoold API socket")
	f.String("log-level", "warn", "log level on stderr")
	var o branchcmd.Options
	o.Register(f)
	if err := f.Parse(args); err != nil || len(f.Args()) != 1 {
		execFull() // the full CLI parses it and says what is wrong
	}
	addr := *api
	if addr == "" {
		addr = runcmd.APIAddress(*root)
	}
	err := branchcmd.Run(&o, addr, os.Stdout)
	switch {
	case errors.Is(err, runwire.ErrDial):
		execFull()
	case err != nil:
		fmt.Fprintf(os.Stderr, "tidepool: %v\n", err)
		return 1
	}
	return 0
}

// execFull replaces this process with the full CLI, arguments unchanged.
func execFull() {
	path := ""
	if self, err := os.Executable(); err == nil {
		if p := filepath.Join(filepath.Dir(self), FullCLI); isExecutable(p) {
			path = p
		}
	}
	if path == "" {
		p, err := exec.LookPath(FullCLI)
		if err != nil {
			fmt.Fprintf(os.Stderr, "tidepool: the full CLI %s is neither beside this binary nor on PATH: %v\n", FullCLI, err)
			os.Exit(1)
		}
		path = p
	}
	argv := append([]string{"tidepool"}, os.Args[1:]...)
	err := syscall.Exec(path, argv, os.Environ())
	fmt.Fprintf(os.Stderr, "tidepool: exec %s: %v\n", path, err)
	os.Exit(1)
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0
}

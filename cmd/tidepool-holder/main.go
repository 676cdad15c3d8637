// Command tidepool-holder is pid 1 of a warm-pool member: it waits, using no CPU
// (the member is frozen), until tidepoold hands it a workload over its control socket,
// then becomes that workload with execve, so the workload is the container's init
// process with the task's pid, and its exit status is the task's.
//
// It is a static binary without the net package (it must run in any image), and it
// touches nothing outside its control directory before the request: a member whose
// workdir was looked up before its fork was bound must not be used.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/pool/holder"
)

// lean is the environment variable and value the holder runs under: one P makes the
// Go runtime set up less per-P state (about 110 KiB less anonymous memory measured on
// an idle holder; the runtime reads GOMAXPROCS before main, so the holder re-executes
// itself once to get it). The workload's environment is the request's, not this.
const lean = "GOMAXPROCS=1"

func main() {
	if os.Getenv("GOMAXPROCS") != "1" {
		// On failure, carry on as is: the cost is memory, not correctness.
		syscall.Exec("/proc/self/exe", os.Args, append(os.Environ(), lean))
	}
	dir := holder.ControlDir
	if len(os.Args) > 1 {
		dir = os.Args[1]
	}
	req, fds, err := receive(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "tidepool-holder: %v\n", err)
		os.Exit(125)
	}
	os.Exit(become(req, fds))
}

// receive listens on the control socket, marks the holder ready and takes the one
// request it will ever serve.
func receive(dir string) (holder.ExecRequest, []int, error) {
	sock := filepath.Join(dir, holder.ControlName)
	os.Remove(sock)
	lfd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return holder.ExecRequest{}, nil, err
	}
	// The socket is for tidepoold (root) alone; the directory is 0700 as well.
	old := unix.Umask(0o077)
	err = unix.Bind(lfd, &unix.SockaddrUnix{Name: sock})
	unix.Umask(old)
	if err != nil {
		return holder.ExecRequest{}, nil, fmt.Errorf("bind %s: %w", sock, err)
	}
	if err := unix.Listen(lfd, 4); err != nil {
		return holder.ExecRequest{}, nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, holder.ReadyName), nil, 0o600); err != nil {
		return holder.ExecRequest{}, nil, err
	}
	for {
		cfd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return holder.ExecRequest{}, nil, fmt.Errorf("accept: %w", err)
		}
		req, fds, err := holder.Receive(cfd)
		unix.Close(cfd)
		if err != nil {
			// A client that went away mid-message (a daemon restart) is not the end.
			fmt.Fprintf(os.Stderr, "tidepool-holder: %v\n", err)
			continue
		}
		unix.Close(lfd)
		os.Remove(sock)
		return req, fds, nil
	}
}

// become turns this process into the workload. It returns only on failure, with the
// exit status a shell would give: 127 not found, 126 not executable.
func become(req holder.ExecRequest, fds []int) int {
	if req.Fds {
		for i, fd := range fds {
			if err := unix.Dup3(fd, i, 0); err != nil {
				fmt.Fprintf(os.Stderr, "tidepool-holder: stdio: %v\n", err)
				return 125
			}
		}
	}
	if len(req.Args) == 0 {
		fmt.Fprintln(os.Stderr, "tidepool-holder: no command")
		return 125
	}
	if req.Cwd != "" {
		if err := os.Chdir(req.Cwd); err != nil {
			fmt.Fprintf(os.Stderr, "tidepool-holder: chdir: %v\n", err)
			return 125
		}
	}
	path, err := lookPath(req.Args[0], req.Env)
	if err != nil {
		fmt.Fprintf(os.Stderr, "tidepool-holder: %s: %v\n", req.Args[0], err)
		return 127
	}
	err = syscall.Exec(path, req.Args, req.Env)
	fmt.Fprintf(os.Stderr, "tidepool-holder: exec %s: %v\n", path, err)
	if errors.Is(err, unix.ENOENT) {
		return 127
	}
	return 126
}

// lookPath resolves a command as runc does for a container's process: a name with a
// slash is used as is, anything else is searched in the workload's PATH.
func lookPath(name string, env []string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", errors.New("command not found")
}

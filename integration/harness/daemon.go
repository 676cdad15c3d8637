package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// DaemonSpec says how to run a background process for a test.
type DaemonSpec struct {
	// Name is used in messages; it defaults to the base name of Path.
	Name string
	Path string
	Args []string
	// Env is the complete environment; nil inherits the test's.
	Env []string
	Dir string
	// LogPath receives stdout and stderr, appended across restarts. Required
	// by Start; StartDaemon defaults it to a file in t.TempDir().
	LogPath string
	// Ready is polled until it returns nil; nil means ready once started.
	Ready func(ctx context.Context) error
	// Notify: the daemon speaks systemd's notify protocol (a Type=notify unit). Start
	// gives it a NOTIFY_SOCKET and waits for READY=1 before it polls Ready, as systemd
	// waits for it before it calls the unit started.
	Notify bool
	// ReadyTimeout bounds the wait for READY=1 and Ready (default 30s).
	ReadyTimeout time.Duration
	// StopTimeout is how long Stop waits after SIGTERM before SIGKILL (default 10s).
	StopTimeout time.Duration
}

// Daemon is a background process under test: started in its own process
// group, killed if the test binary dies (PR_SET_PDEATHSIG), stopped with
// SIGTERM then SIGKILL, restartable with the same spec.
type Daemon struct {
	spec DaemonSpec

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd exits
	err  error         // cmd.Wait result, valid once done is closed
}

// NewDaemon returns a daemon that is not started yet.
func NewDaemon(spec DaemonSpec) *Daemon {
	if spec.Name == "" {
		spec.Name = filepath.Base(spec.Path)
	}
	if spec.ReadyTimeout == 0 {
		spec.ReadyTimeout = 30 * time.Second
	}
	if spec.StopTimeout == 0 {
		spec.StopTimeout = 10 * time.Second
	}
	return &Daemon{spec: spec}
}

// StartDaemon starts a daemon, waits until it is ready and registers a cleanup
// that stops it, kills whatever it left in its process group, and prints the
// tail of its log when the test failed. A start failure fails the test.
func StartDaemon(t testing.TB, spec DaemonSpec) *Daemon {
	t.Helper()
	d := NewDaemon(spec)
	if d.spec.LogPath == "" {
		d.spec.LogPath = filepath.Join(t.TempDir(), d.spec.Name+".log")
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("%v", err)
		}
		if t.Failed() {
			t.Logf("last lines of %s (%s):\n%s", d.spec.Name, d.spec.LogPath, d.LogTail(60))
		}
	})
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return d
}

// Start starts the process and waits until Ready succeeds. On failure the
// process is killed and the error carries the tail of its log.
func (d *Daemon) Start(ctx context.Context) error {
	if d.spec.LogPath == "" {
		return fmt.Errorf("start %s: DaemonSpec.LogPath is required", d.spec.Name)
	}
	d.mu.Lock()
	if d.cmd != nil && !isClosed(d.done) {
		d.mu.Unlock()
		return fmt.Errorf("start %s: already running (pid %d)", d.spec.Name, d.cmd.Process.Pid)
	}
	logf, err := os.OpenFile(d.spec.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		d.mu.Unlock()
		return fmt.Errorf("start %s: %w", d.spec.Name, err)
	}
	fmt.Fprintf(logf, "=== %s: start %s %s\n", time.Now().Format(time.RFC3339Nano), d.spec.Path, strings.Join(d.spec.Args, " "))
	cmd := exec.Command(d.spec.Path, d.spec.Args...)
	cmd.Env = d.spec.Env
	var notified <-chan struct{}
	if d.spec.Notify {
		n, err := listenNotify()
		if err != nil {
			logf.Close()
			d.mu.Unlock()
			return fmt.Errorf("start %s: %w", d.spec.Name, err)
		}
		defer n.close()
		if cmd.Env == nil {
			cmd.Env = os.Environ()
		}
		cmd.Env = append(cmd.Env, "NOTIFY_SOCKET="+n.path)
		notified = n.ready
	}
	cmd.Dir = d.spec.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	err = startOnForkThread(cmd)
	logf.Close() // the child holds its own copy
	if err != nil {
		d.mu.Unlock()
		return fmt.Errorf("start %s: %w", d.spec.Name, err)
	}
	done := make(chan struct{})
	d.cmd, d.done, d.err = cmd, done, nil
	go func() {
		err := cmd.Wait()
		d.mu.Lock()
		d.err = err
		d.mu.Unlock()
		close(done)
	}()
	d.mu.Unlock()

	if err := d.waitReady(ctx, done, notified); err != nil {
		_ = d.Kill()
		return fmt.Errorf("start %s: %w\nlast lines of %s:\n%s", d.spec.Name, err, d.spec.LogPath, d.LogTail(40))
	}
	return nil
}

func (d *Daemon) waitReady(ctx context.Context, done, notified <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, d.spec.ReadyTimeout)
	defer cancel()
	if notified != nil {
		select {
		case <-notified:
		case <-done:
			return fmt.Errorf("exited before it notified READY=1: %v", d.exitErr())
		case <-ctx.Done():
			return fmt.Errorf("no READY=1 notification after %v", d.spec.ReadyTimeout)
		}
	}
	if d.spec.Ready == nil {
		return nil
	}
	delay := 5 * time.Millisecond
	for {
		err := d.spec.Ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("exited before it was ready: %v", d.exitErr())
		case <-ctx.Done():
			return fmt.Errorf("not ready after %v: %w", d.spec.ReadyTimeout, err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 100*time.Millisecond)
	}
}

// Stop sends SIGTERM and waits for the process to exit, sending SIGQUIT (then
// SIGKILL) after StopTimeout and reporting that it had to. Stopping a daemon that is
// not running does nothing.
func (d *Daemon) Stop() error {
	cmd, done := d.current()
	if cmd == nil || isClosed(done) {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
		return nil
	case <-time.After(d.spec.StopTimeout):
	}
	// A Go daemon dumps its goroutines to its log on SIGQUIT: what it was stuck on.
	_ = cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
	return fmt.Errorf("stop %s: still running %v after SIGTERM, killed with SIGQUIT (goroutines in %s)", d.spec.Name, d.spec.StopTimeout, d.spec.LogPath)
}

// Kill sends SIGKILL (a crash, as far as the daemon's clients can tell) and
// waits for the process to exit.
func (d *Daemon) Kill() error {
	cmd, done := d.current()
	if cmd == nil || isClosed(done) {
		return nil
	}
	if err := cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kill %s: %w", d.spec.Name, err)
	}
	<-done
	return nil
}

// Restart stops the daemon (if it runs) and starts it again.
func (d *Daemon) Restart(ctx context.Context) error {
	if err := d.Stop(); err != nil {
		return err
	}
	return d.Start(ctx)
}

// Close stops the daemon and kills anything left in its process group
// (helpers it forked and never reaped). Shims that containerd starts make their
// own process groups and are not touched.
func (d *Daemon) Close() error {
	err := d.Stop()
	if cmd, _ := d.current(); cmd != nil && cmd.Process.Pid > 1 {
		// The group id is the leader's pid (Setpgid). Once the leader has been
		// reaped a new process could take that pid, but not that group: a
		// process group lives while any member does, so no other can get its id.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	return err
}

// Pid is the process id of the running daemon, 0 if it is not running.
func (d *Daemon) Pid() int {
	cmd, done := d.current()
	if cmd == nil || isClosed(done) {
		return 0
	}
	return cmd.Process.Pid
}

// Running reports whether the daemon's process is alive.
func (d *Daemon) Running() bool { return d.Pid() != 0 }

// Exited is closed when the current process exits (a closed channel if the
// daemon was never started).
func (d *Daemon) Exited() <-chan struct{} {
	_, done := d.current()
	if done == nil {
		c := make(chan struct{})
		close(c)
		return c
	}
	return done
}

// ExitErr is how the last process ended (nil for status 0 or while running).
func (d *Daemon) ExitErr() error { return d.exitErr() }

func (d *Daemon) exitErr() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

// LogPath is the file holding the daemon's output.
func (d *Daemon) LogPath() string { return d.spec.LogPath }

// LogTail returns the last n lines of the daemon's log.
func (d *Daemon) LogTail(n int) string { return tailFile(d.spec.LogPath, n) }

func (d *Daemon) current() (*exec.Cmd, chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cmd, d.done
}

// forkThread runs functions on one goroutine locked to its OS thread for the
// life of the test binary. PR_SET_PDEATHSIG fires when the parent *thread*
// exits, and Go ends a thread when a goroutine that locked it returns; forking
// daemons from a thread that never ends means they die with the test binary,
// and only then.
var forkThread = sync.OnceValue(func() chan func() {
	ch := make(chan func())
	go func() {
		runtime.LockOSThread() // never unlocked
		for f := range ch {
			f()
		}
	}()
	return ch
})

func startOnForkThread(cmd *exec.Cmd) error {
	errc := make(chan error, 1)
	forkThread() <- func() { errc <- cmd.Start() }
	return <-errc
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// tailFile returns the last n lines of a file, reading at most its last 256 KiB.
func tailFile(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	defer f.Close()
	const window = 256 << 10
	if fi, err := f.Stat(); err == nil && fi.Size() > window {
		if _, err := f.Seek(fi.Size()-window, io.SeekStart); err != nil {
			return fmt.Sprintf("(cannot read %s: %v)", path, err)
		}
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// notifySocket is the datagram socket systemd gives a Type=notify service
// (NOTIFY_SOCKET): ready is closed when a message carries READY=1.
type notifySocket struct {
	dir, path string
	conn      *net.UnixConn
	ready     chan struct{}
}

func listenNotify() (*notifySocket, error) {
	dir, err := os.MkdirTemp("", "notify-")
	if err != nil {
		return nil, err
	}
	n := &notifySocket{dir: dir, path: filepath.Join(dir, "notify.sock"), ready: make(chan struct{})}
	n.conn, err = net.ListenUnixgram("unixgram", &net.UnixAddr{Name: n.path, Net: "unixgram"})
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("notify socket: %w", err)
	}
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := n.conn.Read(buf)
			if err != nil {
				return
			}
			for _, line := range strings.Split(string(buf[:k]), "\n") {
				if line == "READY=1" {
					close(n.ready)
					return
				}
			}
		}
	}()
	return n, nil
}

func (n *notifySocket) close() {
	n.conn.Close()
	os.RemoveAll(n.dir)
}

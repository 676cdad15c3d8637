package peercred

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestTrusted(t *testing.T) {
	if err := Trusted(&unix.Ucred{Uid: 0}); err != nil {
		t.Fatalf("root: %v", err)
	}
	if err := Trusted(&unix.Ucred{Uid: uint32(os.Geteuid())}); err != nil {
		t.Fatalf("ourselves: %v", err)
	}
	other := uint32(54321)
	if os.Geteuid() == int(other) {
		other++
	}
	if err := Trusted(&unix.Ucred{Uid: other, Pid: 7}); !errors.Is(err, ErrUntrusted) {
		t.Fatalf("uid %d: %v", other, err)
	}
}

func TestCheckDir(t *testing.T) {
	base := t.TempDir()
	for _, tc := range []struct {
		mode os.FileMode
		ok   bool
	}{
		{0o700, true}, {0o755, true}, {0o777, false}, {0o770, false}, {0o777 | os.ModeSticky, true},
	} {
		d := filepath.Join(base, tc.mode.String())
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, tc.mode); err != nil {
			t.Fatal(err)
		}
		if err := CheckDir(d); (err == nil) != tc.ok {
			t.Errorf("%v: %v", tc.mode, err)
		}
		// A writable ancestor is as bad as a writable directory.
		inner := filepath.Join(d, "run")
		os.Mkdir(inner, 0o700)
		if err := CheckDir(inner); (err == nil) != tc.ok {
			t.Errorf("below %v: %v", tc.mode, err)
		}
	}
	if err := CheckDir(filepath.Join(base, "missing")); err == nil {
		t.Error("no error for a missing directory")
	}
}

// TestListenerOwnUser: a connection from this process's user gets through and is
// served; run as root, one from uid 65534 is dropped before anything is read.
func TestListenerOwnUser(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	raw, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	refused := make(chan error, 4)
	l := Listener(raw, func(err error) { refused <- err })
	defer l.Close()
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := CheckConn(c); err != nil {
		t.Fatalf("the server is this process: %v", err)
	}
	select {
	case s := <-accepted:
		s.Close()
	case err := <-refused:
		t.Fatalf("own connection refused: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("own connection not accepted")
	}
	if os.Geteuid() != 0 {
		t.Log("not root: the other-user half needs root to become uid 65534")
		return
	}
	os.Chmod(filepath.Dir(filepath.Dir(sock)), 0o755)
	os.Chmod(filepath.Dir(sock), 0o755)
	os.Chmod(sock, 0o777)
	done := make(chan error, 1)
	go func() {
		// Only this thread becomes uid 65534; it is never given back to the runtime.
		runtime.LockOSThread()
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, 65534, 65534, 65534); e != 0 {
			done <- e
			return
		}
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
		if err == nil {
			err = unix.Connect(fd, &unix.SockaddrUnix{Name: sock})
			buf := make([]byte, 1)
			if err == nil {
				unix.Read(fd, buf) // returns once the server drops us
			}
			unix.Close(fd)
		}
		done <- err
	}()
	if err := <-done; err != nil {
		t.Fatalf("connect as uid 65534: %v", err)
	}
	select {
	case err := <-refused:
		if !errors.Is(err, ErrUntrusted) {
			t.Fatalf("refused with %v", err)
		}
	case s := <-accepted:
		s.Close()
		t.Fatal("a connection from uid 65534 was accepted")
	case <-time.After(5 * time.Second):
		t.Fatal("the other user's connection was neither accepted nor refused")
	}
}

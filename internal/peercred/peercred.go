// Package peercred checks who is at the other end of a local unix socket, and who can
// replace one. tidepoold's sockets carry what only root may ask for (a pool claim runs
// a workload; a bind mounts a fork), and the shim hands the API container specs with
// their environment, so both ends check the kernel's SO_PEERCRED instead of trusting
// a path: the server accepts only root (or its own uid), the clients talk only to a
// server running as root (or as themselves).
package peercred

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Of returns the credentials of a unix connection's peer, as the kernel recorded them
// at connect (or listen, for the server a client connected to).
func Of(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("peer credentials: %T is not a unix connection", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// ErrUntrusted says the peer is neither root nor this process's own user.
var ErrUntrusted = errors.New("peer is neither root nor this process's user")

// Trusted accepts root and this process's effective uid.
func Trusted(cred *unix.Ucred) error {
	if cred.Uid == 0 || int(cred.Uid) == os.Geteuid() {
		return nil
	}
	return fmt.Errorf("%w: pid %d uid %d", ErrUntrusted, cred.Pid, cred.Uid)
}

// CheckConn checks a connection's peer with Trusted.
func CheckConn(c net.Conn) error {
	cred, err := Of(c)
	if err != nil {
		return err
	}
	return Trusted(cred)
}

// Listener drops connections from untrusted peers before anything is read from them,
// reporting each to refused.
func Listener(l net.Listener, refused func(error)) net.Listener {
	return &listener{Listener: l, refused: refused}
}

type listener struct {
	net.Listener
	refused func(error)
}

func (l *listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if err := CheckConn(c); err != nil {
			c.Close()
			if l.refused != nil {
				l.refused(err)
			}
			continue
		}
		return c, nil
	}
}

// CheckDir refuses a directory a socket is about to be created in when another user
// could replace the socket: one owned by someone other than root or us, or writable
// by group or others without the sticky bit (which stops them renaming our file).
func CheckDir(dir string) error {
	st, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	return checkAncestor(dir)
}

// checkAncestor applies the rule to dir and every directory above it: a writable
// ancestor lets its writer rename the whole subtree.
func checkAncestor(dir string) error {
	st, err := os.Stat(dir)
	if err != nil {
		return err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%s: no owner information", dir)
	}
	if sys.Uid != 0 && int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("%s belongs to uid %d: another user could replace the sockets below it", dir, sys.Uid)
	}
	if st.Mode().Perm()&0o022 != 0 && st.Mode()&os.ModeSticky == 0 {
		return fmt.Errorf("%s is %v: writable by other users, who could replace the sockets below it", dir, st.Mode().Perm())
	}
	if parent := filepath.Dir(dir); parent != dir {
		return checkAncestor(parent)
	}
	return nil
}

package holder

import (
	"bufio"
	"encoding/binary"
	"errors"

	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func sample() ExecRequest {
	return ExecRequest{Args: []string{"sh", "-c", "echo hi"}, Env: []string{"PATH=/bin", "API_TOKEN=x=y"}, Cwd: "/app", Fds: true}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	for _, req := range []ExecRequest{
		sample(),
		{Args: []string{"true"}},
		{Args: []string{"x", "ünïcödé", strings.Repeat("a", 1000)}, Env: []string{"A="}},
	} {
		b, err := Encode(req)
		if err != nil {
			t.Fatal(err)
		}
		if n := binary.BigEndian.Uint32(b); int(n) != len(b)-4 {
			t.Fatalf("header says %d, body is %d", n, len(b)-4)
		}
		got, err := Decode(b)
		if err != nil || !reflect.DeepEqual(got, req) {
			t.Fatalf("round trip: %+v %v, want %+v", got, err, req)
		}
	}
}

func frame(body string) []byte {
	b := make([]byte, 4, 4+len(body))
	binary.BigEndian.PutUint32(b, uint32(len(body)))
	return append(b, body...)
}

func TestDecodeRefuses(t *testing.T) {
	huge := make([]byte, 4)
	binary.BigEndian.PutUint32(huge, MaxRequestSize+1)
	for _, tc := range []struct {
		name  string
		frame []byte
		want  error
	}{
		{"empty", nil, ErrShort},
		{"half a header", []byte{0, 0}, ErrShort},
		{"header only", frame("{}")[:4], ErrShort},
		{"short body", frame(`{"args":["x"]}`)[:8], ErrShort},
		{"oversized header", huge, ErrTooLarge},
		{"all ones", []byte{0xff, 0xff, 0xff, 0xff, '{'}, ErrTooLarge},
		{"trailing bytes", append(frame(`{"args":["x"]}`), 'z'), ErrMalformed},
		{"not json", frame("hello"), ErrMalformed},
		{"json of the wrong shape", frame(`{"args":"x"}`), ErrMalformed},
		{"zero length", frame(""), ErrMalformed},
		{"no command", frame(`{"args":[]}`), ErrMalformed},
		{"empty command", frame(`{"args":[""]}`), ErrMalformed},
		{"NUL in argv", frame(`{"args":["a\u0000b"]}`), ErrMalformed},
		{"env without =", frame(`{"args":["x"],"env":["NOVALUE"]}`), ErrMalformed},
		{"env with empty key", frame(`{"args":["x"],"env":["=v"]}`), ErrMalformed},
		{"relative cwd", frame(`{"args":["x"],"cwd":"app"}`), ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(tc.frame)
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}
	big := ExecRequest{Args: []string{strings.Repeat("a", MaxRequestSize)}}
	if _, err := Encode(big); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("encoding an oversized request: %v", err)
	}
}

// FuzzDecode: no input makes Decode panic, and whatever it accepts re-encodes to a
// frame that decodes to the same request.
func FuzzDecode(f *testing.F) {
	good, _ := Encode(sample())
	f.Add(good)
	f.Add(frame(`{"args":["x"]}`))
	f.Add(frame(`{"args":["x"],"env":["A=1"],"cwd":"/","fds":true}`))
	f.Add([]byte{})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Add(frame("null"))
	f.Add(frame(`{"args":["\u0000"]}`))
	f.Add(append(frame(`{"args":["x"]}`), 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := Decode(b)
		if err != nil {
			return
		}
		again, err := Encode(req)
		if err != nil {
			t.Fatalf("accepted %q but cannot encode it: %v", b, err)
		}
		back, err := Decode(again)
		if err != nil || !reflect.DeepEqual(back, req) {
			t.Fatalf("re-encoded %+v decodes to %+v, %v", req, back, err)
		}
	})
}

// pair is a connected stream socket pair: what the holder reads and what the
// daemon writes.
func pair(t *testing.T) (rd, wr int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	return fds[0], fds[1]
}

// TestReceiveShortReads: a request written a byte at a time, descriptors with the
// first byte, arrives whole, with its descriptors.
func TestReceiveShortReads(t *testing.T) {
	rd, wr := pair(t)
	msg, _ := Encode(sample())
	stdio := devNulls(t)
	rights := unix.UnixRights(int(stdio[0].Fd()), int(stdio[1].Fd()), int(stdio[2].Fd()))
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		for i := range msg {
			var oob []byte
			if i == 0 {
				oob = rights
			}
			unix.Sendmsg(wr, msg[i:i+1], oob, nil, 0)
			time.Sleep(50 * time.Microsecond)
		}
	}()
	defer func() { <-sent }()
	req, fds, err := Receive(rd)
	if err != nil || !reflect.DeepEqual(req, sample()) || len(fds) != 3 {
		t.Fatalf("request %+v, %d fds, %v", req, len(fds), err)
	}
	for _, fd := range fds {
		unix.Close(fd)
	}
}

func devNulls(t *testing.T) []*os.File {
	var out []*os.File
	for i := 0; i < 3; i++ {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		out = append(out, f)
	}
	return out
}

// TestReceiveRefuses: a writer that stops mid-frame, announces too much, sends
// garbage, or sends the wrong number of descriptors gets an error, and the
// descriptors it sent are closed.
func TestReceiveRefuses(t *testing.T) {
	good, _ := Encode(ExecRequest{Args: []string{"x"}})
	huge := []byte{0x7f, 0, 0, 0}
	for _, tc := range []struct {
		name  string
		bytes []byte
		fds   int
		want  error
	}{
		{"cut in the header", good[:2], 0, ErrShort},
		{"cut in the body", good[:len(good)-3], 0, ErrShort},
		{"oversized", huge, 0, ErrTooLarge},
		{"garbage", frame("]]]]"), 0, ErrMalformed},
		{"descriptors without asking", good, 3, ErrMalformed},
		{"too few descriptors", mustEncode(ExecRequest{Args: []string{"x"}, Fds: true}), 1, ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rd, wr := pair(t)
			var oob []byte
			if tc.fds > 0 {
				fs := devNulls(t)
				var fds []int
				for _, f := range fs[:tc.fds] {
					fds = append(fds, int(f.Fd()))
				}
				oob = unix.UnixRights(fds...)
			}
			if err := unix.Sendmsg(wr, tc.bytes, oob, nil, 0); err != nil {
				t.Fatal(err)
			}
			unix.Shutdown(wr, unix.SHUT_WR)
			before := openFds(t)
			_, fds, err := Receive(rd)
			if !errors.Is(err, tc.want) || fds != nil {
				t.Fatalf("error %v (fds %v), want %v", err, fds, tc.want)
			}
			if after := openFds(t); after > before {
				t.Fatalf("%d descriptors open after a refused request, %d before", after, before)
			}
		})
	}
}

func mustEncode(r ExecRequest) []byte {
	b, err := Encode(r)
	if err != nil {
		panic(err)
	}
	return b
}

func openFds(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// listen binds a control socket in a fresh directory, as the holder does.
func listen(t *testing.T) (string, int) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), ControlName)
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 4); err != nil {
		t.Fatal(err)
	}
	return sock, fd
}

// TestSendExecChecksPeer: the workload goes only to the expected listener; any other
// gets a connection and not one byte.
func TestSendExecChecksPeer(t *testing.T) {
	sock, lfd := listen(t)
	self := Peer{Pid: int32(os.Getpid())}
	received := func() ([]byte, error) {
		cfd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
		if err != nil {
			return nil, err
		}
		defer unix.Close(cfd)
		var out []byte
		buf := make([]byte, 4096)
		for {
			n, err := unix.Read(cfd, buf)
			if n <= 0 || err != nil {
				return out, nil
			}
			out = append(out, buf[:n]...)
		}
	}
	for _, wrong := range []Peer{{Pid: 1}, {Pid: 0}, {Pid: self.Pid, Cgroup: "/surely/not/this/one"}} {
		err := SendExec(sock, wrong, sample(), devNulls(t))
		if err == nil || !strings.Contains(err.Error(), "refusing") {
			t.Fatalf("peer %+v: %v", wrong, err)
		}
		if b, err := received(); err != nil || len(b) != 0 {
			t.Fatalf("peer %+v received %q (%v)", wrong, b, err)
		}
	}
	if err := SendExec(sock, self, sample(), devNulls(t)); err != nil {
		t.Fatal(err)
	}
	cfd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(cfd)
	req, fds, err := Receive(cfd)
	if err != nil || !reflect.DeepEqual(req, sample()) || len(fds) != 3 {
		t.Fatalf("the expected listener got %+v, %d fds, %v", req, len(fds), err)
	}
	for _, fd := range fds {
		unix.Close(fd)
	}
	// Our own cgroup, as /proc shows it, passes the cgroup check.
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	cg := ""
	for _, line := range strings.Split(string(own), "\n") {
		if f := strings.SplitN(line, ":", 3); len(f) == 3 && (f[1] == "freezer" || f[0] == "0" && f[1] == "") {
			cg = f[2]
			if f[1] == "freezer" {
				break
			}
		}
	}
	if in, err := InCgroup(os.Getpid(), cg); err != nil {
		t.Fatal(err)
	} else if !in {
		t.Logf("this process is not in one cgroup across its v1 hierarchies (%q); skipping the positive cgroup check", own)
	}
}

func TestInCgroup(t *testing.T) {
	v1 := "9:name=systemd:/system.slice/x\n8:pids:/ns/ctr\n6:freezer:/ns/ctr\n4:memory:/ns/ctr\n1:cpu,cpuacct:/ns/ctr\n5:devices:/ns/ctr\n0::/\n"
	for _, tc := range []struct {
		procs, cg string
		want      bool
	}{
		{v1, "/ns/ctr", true},
		{v1, "ns/ctr", true},
		{v1, "/ns/ctr/", true},
		{v1, "/ns/other", false},
		{strings.Replace(v1, "4:memory:/ns/ctr", "4:memory:/ns/member", 1), "/ns/ctr", false},
		{"0::/ns/ctr\n", "/ns/ctr", true},
		{"0::/ns/other\n", "/ns/ctr", false},
		{"", "/ns/ctr", false},
		{"garbage\n", "/ns/ctr", false},
	} {
		got, err := inCgroup(bufio.NewScanner(strings.NewReader(tc.procs)), tc.cg)
		if err != nil || got != tc.want {
			t.Errorf("%q in %q: %v %v, want %v", tc.cg, tc.procs, got, err, tc.want)
		}
	}
	if _, err := InCgroup(-1, "/x"); err == nil {
		t.Fatal("no error for a process that does not exist")
	}
}

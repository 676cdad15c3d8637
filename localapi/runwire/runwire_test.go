package runwire

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
)

func pair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("unix", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.UnixConn), s.(*net.UnixConn)
}

func TestAddress(t *testing.T) {
	for in, want := range map[string]string{"/run/tidepool/api.sock": "/run/tidepool/api-run.sock", "/x/api": "/x/api-run.sock"} {
		if got := Address(in); got != want {
			t.Errorf("Address(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestFrameCarriesDescriptors: a start and its three descriptors arrive together,
// and a descriptor received is the same open file (a write through it reaches the
// sender's pipe).
func TestFrameCarriesDescriptors(t *testing.T) {
	c, s := pair(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	start := Start{Pool: "p", Fork: "f", Args: []string{"a", "b c"}, Env: []string{"K=V"}, Discard: true}
	if err := WriteFrame(c, Request{Start: &start}, []int{int(w.Fd()), int(w.Fd()), int(w.Fd())}); err != nil {
		t.Fatal(err)
	}
	w.Close()
	var got Request
	files, err := ReadFrame(s, &got, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 3 || got.Start == nil || got.Start.Pool != "p" || got.Start.Args[1] != "b c" || !got.Start.Discard {
		t.Fatalf("got %d files, request %+v", len(files), got.Start)
	}
	files[1].Write([]byte("hi"))
	for _, f := range files {
		f.Close()
	}
	b, _ := io.ReadAll(r)
	if string(b) != "hi" {
		t.Fatalf("read %q through the passed descriptor", b)
	}
}

func TestFrameRefusals(t *testing.T) {
	t.Run("too many descriptors", func(t *testing.T) {
		c, s := pair(t)
		f, _ := os.Open(os.DevNull)
		defer f.Close()
		fd := int(f.Fd())
		if err := WriteFrame(c, Request{Signal: 2}, []int{fd, fd, fd, fd}); err != nil {
			t.Fatal(err)
		}
		var got Request
		if files, err := ReadFrame(s, &got, 3); !errors.Is(err, ErrMalformed) || files != nil {
			t.Fatalf("err %v, files %v; want ErrMalformed and none", err, files)
		}
	})
	t.Run("oversized", func(t *testing.T) {
		c, s := pair(t)
		hdr := make([]byte, 4)
		binary.BigEndian.PutUint32(hdr, MaxFrame+1)
		c.Write(hdr)
		var got Request
		if _, err := ReadFrame(s, &got, 0); !errors.Is(err, ErrMalformed) {
			t.Fatalf("err %v, want ErrMalformed", err)
		}
	})
	t.Run("garbage", func(t *testing.T) {
		c, s := pair(t)
		c.Write([]byte{0, 0, 0, 3, '{', 'x', '}'})
		var got Request
		if _, err := ReadFrame(s, &got, 0); !errors.Is(err, ErrMalformed) {
			t.Fatalf("err %v, want ErrMalformed", err)
		}
	})
	t.Run("short", func(t *testing.T) {
		c, s := pair(t)
		c.Write([]byte{0, 0, 0, 9, '{'})
		c.Close()
		var got Request
		if _, err := ReadFrame(s, &got, 0); err == nil {
			t.Fatal("a truncated frame was read")
		}
	})
	t.Run("closed", func(t *testing.T) {
		c, s := pair(t)
		c.Close()
		var got Request
		if _, err := ReadFrame(s, &got, 0); !errors.Is(err, io.EOF) {
			t.Fatalf("err %v, want EOF", err)
		}
	})
}

// TestHandOverOnlyPipes: a pipe is handed over as it is; a regular file (or any
// non-pipe) is relayed through a new pipe, and what the workload writes reaches it.
func TestHandOverOnlyPipes(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	file, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	h, relays, err := handOver(Stdio{Stdin: file, Stdout: w, Stderr: file})
	if err != nil {
		t.Fatal(err)
	}
	if h.files[1] != w || h.child[1] {
		t.Fatal("a pipe stdout was not handed over as it is")
	}
	for _, i := range []int{0, 2} {
		if h.files[i] == file || !isPipe(h.files[i]) || !h.child[i] {
			t.Fatalf("stream %d: a regular file was handed over, or not through a pipe", i)
		}
	}
	h.files[2].Write([]byte("to the file"))
	h.closeChildEnds()
	relays.wait()
	b, _ := os.ReadFile(file.Name())
	if string(b) != "to the file" {
		t.Fatalf("relayed %q", b)
	}
}

// TestRunRefusedAndVanished: the client reports tidepoold's refusal as an *Error,
// and a daemon that closes without a result as such.
func TestRunRefusedAndVanished(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reply func(*net.UnixConn)
		check func(*testing.T, *Exit, error)
	}{
		{"refused", func(s *net.UnixConn) {
			WriteFrame(s, Response{Error: &Error{Code: "not found", Message: `pool "x": not found`}}, nil)
		}, func(t *testing.T, e *Exit, err error) {
			var we *Error
			if !errors.As(err, &we) || we.Code != "not found" || e != nil {
				t.Fatalf("got %v, %v", e, err)
			}
		}},
		{"exit", func(s *net.UnixConn) {
			WriteFrame(s, Response{Started: "m1"}, nil)
			WriteFrame(s, Response{Exit: &Exit{Status: 7, Member: "m1", Root: "ab"}}, nil)
		}, func(t *testing.T, e *Exit, err error) {
			if err != nil || e.Status != 7 || e.Member != "m1" {
				t.Fatalf("got %+v, %v", e, err)
			}
		}},
		{"vanished", func(s *net.UnixConn) {}, func(t *testing.T, e *Exit, err error) {
			if err == nil || e != nil {
				t.Fatalf("got %+v, %v", e, err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "run.sock")
			l, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			go func() {
				c, err := l.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				var req Request
				files, err := ReadFrame(c.(*net.UnixConn), &req, 3)
				for _, f := range files {
					f.Close()
				}
				if err == nil {
					tc.reply(c.(*net.UnixConn))
				}
			}()
			r, w, _ := os.Pipe()
			defer r.Close()
			defer w.Close()
			exit, err := Run(sock, Start{Pool: "x", Args: []string{"true"}}, Stdio{Stdout: w, Stderr: w}, nil, nil)
			tc.check(t, exit, err)
		})
	}
}

// Package s3test starts a real S3 server (MinIO) for tests: one per test, with its
// own data directory, a random loopback port and a root user and password that the
// test passes through the standard AWS_* environment variables. The server is
// killed and its directory removed when the test ends, even on failure.
package s3test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/tidepool-dev/tidepool/integration/testenv"
)

// Server is a running MinIO.
type Server struct {
	t        testing.TB
	bin      string
	dir      string
	Addr     string // 127.0.0.1:PORT
	User     string
	Password string
	Bucket   string
	cmd      *exec.Cmd
	exited   chan struct{}
	logFile  *os.File
}

// Endpoint is the server's URL (plain HTTP on loopback).
func (s *Server) Endpoint() string { return "http://" + s.Addr }

// Start runs MinIO with a fresh bucket, and sets AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL for the test. It skips the test if the
// minio binary is not installed (`make deps` builds it).
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := testenv.Tool("minio")
	if err != nil {
		t.Skipf("skipping: %v", err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir(), User: "tidepool-" + randHex(4), Password: randHex(16), Bucket: "tidepool-test"}
	s.startOn(t, freePort(t))
	t.Cleanup(s.Kill)
	c := s.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.MakeBucket(ctx, s.Bucket, minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("create bucket: %v", err)
	}
	if tt, ok := t.(interface{ Setenv(string, string) }); ok {
		tt.Setenv("AWS_ACCESS_KEY_ID", s.User)
		tt.Setenv("AWS_SECRET_ACCESS_KEY", s.Password)
		tt.Setenv("AWS_ENDPOINT_URL", s.Endpoint())
		tt.Setenv("AWS_REGION", "us-east-1")
	}
	return s
}

func (s *Server) startOn(t testing.TB, addr string) {
	t.Helper()
	logf, err := os.OpenFile(filepath.Join(s.dir, "minio.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(s.bin, "server", "--quiet", "--address", addr, "--console-address", "127.0.0.1:0", filepath.Join(s.dir, "data"))
	cmd.Env = append(os.Environ(), "MINIO_ROOT_USER="+s.User, "MINIO_ROOT_PASSWORD="+s.Password,
		"MINIO_BROWSER=off", "MINIO_UPDATE=off", "MINIO_CI_CD=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("start minio: %v", err)
	}
	s.cmd, s.Addr, s.logFile = cmd, addr, logf
	s.exited = make(chan struct{})
	go func() { cmd.Wait(); close(s.exited) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/minio/health/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-s.exited:
			b, _ := os.ReadFile(filepath.Join(s.dir, "minio.log"))
			t.Fatalf("minio exited at start: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			s.Kill()
			t.Fatalf("minio did not become ready on %s within 60s", addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Kill stops the server at once (SIGKILL), as a crash would.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	s.cmd.Process.Kill()
	<-s.exited
	s.logFile.Close()
	s.cmd = nil
}

// Restart starts the server again on the same address and data.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Kill()
	s.startOn(t, s.Addr)
}

// Client is an admin client for inspecting the bucket with plain S3 calls.
func (s *Server) Client(t testing.TB) *minio.Client {
	t.Helper()
	c, err := minio.New(s.Addr, &minio.Options{Creds: credentials.NewStaticV4(s.User, s.Password, ""), Region: "us-east-1"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func freePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func randHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprint("crypto/rand: ", err))
	}
	return hex.EncodeToString(b)
}

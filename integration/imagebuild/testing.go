package imagebuild

import (
	"context"
	"errors"
	"testing"
	"time"
)

// BusyboxArchive returns the cached archive of Busybox, building it if needed.
// It skips the test when busybox-static is missing and fails it on other errors.
func BusyboxArchive(t testing.TB) Archive {
	t.Helper()
	return archiveFor(t, func(context.Context) (Spec, error) { return Busybox() })
}

// NodeArchive returns the cached archive of Node (the first call on a machine
// runs npm install against the registry). It skips when node, npm or
// busybox-static is missing.
func NodeArchive(t testing.TB) Archive {
	t.Helper()
	return archiveFor(t, Node)
}

// PauseArchive returns the cached archive of Pause. It skips when the go
// toolchain is missing.
func PauseArchive(t testing.TB) Archive {
	t.Helper()
	return archiveFor(t, Pause)
}

func archiveFor(t testing.TB, spec func(context.Context) (Spec, error)) Archive {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s, err := spec(ctx)
	if errors.Is(err, ErrHostMissing) {
		t.Skipf("skipping: %v", err)
	}
	if err != nil {
		t.Fatalf("image spec: %v", err)
	}
	dir, err := DefaultCacheDir()
	if err != nil {
		t.Fatalf("image cache: %v", err)
	}
	a, err := Cached(s, dir)
	if err != nil {
		t.Fatalf("build image: %v", err)
	}
	return a
}

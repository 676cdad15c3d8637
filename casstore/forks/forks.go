// Package forks keeps fork records: named, mutable pointers to immutable roots. A fork
// is one small record in a bbolt database, so creating one costs the same whatever the
// size of the tree it points at; every later revision is another root hash, and a
// short history keeps the recent ones reachable for diff and for garbage collection.
package forks

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// HistoryLimit is how many past revisions a fork keeps.
const HistoryLimit = 16

// Fork is one fork record. JSON field names are part of the CLI contract
// (`tidepool forks --json`).
type Fork struct {
	ID      string            `json:"id"`
	Label   string            `json:"label"`
	Base    casstore.Hash     `json:"base"`
	Root    casstore.Hash     `json:"root"`
	Created time.Time         `json:"created"`
	Updated time.Time         `json:"updated"`
	TTL     Duration          `json:"ttl,omitempty"`
	Labels  map[string]string `json:"labels,omitempty"`
	History []Revision        `json:"history,omitempty"`
}

// Revision is one past root of a fork, newest last.
type Revision struct {
	Root   casstore.Hash `json:"root"`
	Time   time.Time     `json:"time"`
	Reason string        `json:"reason,omitempty"`
}

// Expired reports whether the fork's TTL has run out at now.
func (f *Fork) Expired(now time.Time) bool {
	return f.TTL > 0 && !now.Before(f.Created.Add(time.Duration(f.TTL)))
}

// CreateRequest describes a new fork.
type CreateRequest struct {
	Base   casstore.Hash
	Label  string
	TTL    time.Duration
	Labels map[string]string
	// RequestID makes the create idempotent: a second create with the same id
	// returns the fork the first one made instead of a duplicate, so a client that
	// lost its answer (the daemon died mid-call) can simply retry. It is kept on the
	// fork as the label RequestIDLabel, which is how it crosses the API.
	RequestID string
}

// RequestIDLabel is the fork label holding the request id that created the fork.
const RequestIDLabel = "tidepool.dev/request-id"

// NewRequestID returns a fresh random request id.
func NewRequestID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("crypto/rand failed: %v", err))
	}
	return hex.EncodeToString(b[:])
}

// requestID is the request id of req, from the field or the label; they must agree.
func (req *CreateRequest) requestID() (string, error) {
	l := req.Labels[RequestIDLabel]
	switch {
	case req.RequestID == "":
		return l, nil
	case l == "" || l == req.RequestID:
		return req.RequestID, nil
	}
	return "", fmt.Errorf("request id %q and label %s=%q disagree: %w", req.RequestID, RequestIDLabel, l, errdefs.ErrInvalidArgument)
}

// Service is what the CLI, the snapshotter and the local API need from fork records.
// The DB implements it directly; the daemon's API client implements it remotely, so
// `tidepool` keeps working while tidepoold owns the database.
type Service interface {
	Create(ctx context.Context, req CreateRequest) (*Fork, error)
	// Get finds a fork by id, or by label when exactly one fork carries it.
	Get(ctx context.Context, ref string) (*Fork, error)
	List(ctx context.Context) ([]*Fork, error)
	Remove(ctx context.Context, id string) error
	// Advance moves a fork to newRoot. If expect is non-zero and the fork's current
	// root differs, it fails with ErrConflict and changes nothing.
	Advance(ctx context.Context, id string, expect, newRoot casstore.Hash, reason string) (*Fork, error)
}

// ErrConflict says a fork moved since the caller read it.
var ErrConflict = fmt.Errorf("fork moved since it was read: %w", errdefs.ErrFailedPrecondition)

// NewID returns a fresh fork id: 8 random bytes as 16 lowercase hex digits, the shape
// LunarFS gives its local workspace records.
func NewID() string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("crypto/rand failed: %v", err))
	}
	return hex.EncodeToString(b[:])
}

// IsID reports whether s has the shape of a fork id.
func IsID(s string) bool {
	if len(s) != 16 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// CheckLabel refuses labels that ROOT|FORK arguments could never resolve to the
// fork: a 64-character string is always read as a root hash, and a label shaped like
// a fork id would be shadowed by a fork with that id.
func CheckLabel(l string) error {
	switch {
	case casstore.LooksLikeHash(l):
		return fmt.Errorf("label %q has the length of a root hash and could never be resolved: %w", l, errdefs.ErrInvalidArgument)
	case IsID(l):
		return fmt.Errorf("label %q has the shape of a fork id: %w", l, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Target is what a "ROOT|FORK" argument names: a root, and the fork it came from if
// it was a fork.
type Target struct {
	Root casstore.Hash
	Fork *Fork
}

// Resolve interprets ref as a root hash (64 hex digits) or a fork id or label. A
// 64-character string is always taken as a hash, so a malformed hash gets the hash
// parser's error instead of "fork not found".
func Resolve(ctx context.Context, svc Service, ref string) (Target, error) {
	if casstore.LooksLikeHash(ref) {
		h, err := casstore.ParseHash(ref)
		if err != nil {
			return Target{}, fmt.Errorf("%w: %w", err, errdefs.ErrInvalidArgument)
		}
		return Target{Root: h}, nil
	}
	if ref == "" {
		return Target{}, fmt.Errorf("empty root or fork: %w", errdefs.ErrInvalidArgument)
	}
	if svc == nil {
		return Target{}, fmt.Errorf("%q is not a root hash and no fork database is available: %w", ref, errdefs.ErrInvalidArgument)
	}
	f, err := svc.Get(ctx, ref)
	if err != nil {
		return Target{}, err
	}
	return Target{Root: f.Root, Fork: f}, nil
}

// Duration is a time.Duration that reads and writes as a string ("1h30m") in JSON.
type Duration time.Duration

// MarshalText renders the duration in Go syntax.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText parses Go duration syntax.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

var errNoFork = errors.New("no such fork")

func notFound(ref string) error {
	return fmt.Errorf("fork %q: %w: %w", ref, errNoFork, errdefs.ErrNotFound)
}

package remote

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/minio/minio-go/v7"

	"github.com/tidepool-dev/tidepool/casstore"
)

// ConflictInfix joins a ref's name and the first 8 hex digits of a rejected root in
// the name of a conflict ref, as LunarFS's server does: main@conflict-1234abcd.
const ConflictInfix = "@conflict-"

// maxRefBody bounds a ref object read (a valid one is 75 bytes).
const maxRefBody = 4096

// Ref is a named root in the bucket.
type Ref struct {
	Name string        `json:"name"`
	Root casstore.Hash `json:"root"`
	// Conflict is set on conflict refs (NAME@conflict-XXXXXXXX), naming NAME.
	Conflict string `json:"conflict_of,omitempty"`
	// ETag is the object's version, the compare part of compare-and-swap.
	ETag string `json:"-"`
}

// ConflictError says a ref moved under a push. The pushed root is kept in the bucket
// as ConflictRef and is complete there; nothing is lost.
type ConflictError struct {
	Ref         string
	Pushed      casstore.Hash
	Current     casstore.Hash // zero if the ref is absent
	Expected    casstore.Hash // zero if the ref was expected absent
	ConflictRef string
}

func (e *ConflictError) Error() string {
	cur := "absent"
	if !e.Current.IsZero() {
		cur = e.Current.String()
	}
	return fmt.Sprintf("ref %s moved (now %s): pushed root %s kept as ref %s", e.Ref, cur, e.Pushed, e.ConflictRef)
}

// Unwrap lets errdefs.IsConflict match.
func (e *ConflictError) Unwrap() error { return errdefs.ErrConflict }

// ConflictName is the conflict ref LunarFS's server writes for a rejected root.
func ConflictName(ref string, root casstore.Hash) string {
	return ref + ConflictInfix + root.String()[:8]
}

// CheckRefName refuses names that are not safe as one key segment and as a ref name
// in LunarFS: 1-200 bytes of [A-Za-z0-9._@-], starting with a letter or digit, with
// no "..".
func CheckRefName(name string) error {
	if name == "" || len(name) > 200 {
		return fmt.Errorf("ref name %q: want 1 to 200 characters: %w", name, errdefs.ErrInvalidArgument)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		ok := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
			i > 0 && (c == '.' || c == '_' || c == '-' || c == '@')
		if !ok {
			return fmt.Errorf("ref name %q: character %q at offset %d is not allowed (letters, digits, and . _ - @ after the first): %w",
				name, c, i, errdefs.ErrInvalidArgument)
		}
	}
	if strings.Contains(name, "..") {
		return fmt.Errorf("ref name %q: \"..\" is not allowed: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// EncodeRef is a ref object's body: exactly {"root":"<64 hex>"}, no space, no newline.
func EncodeRef(root casstore.Hash) []byte {
	return []byte(`{"root":"` + root.String() + `"}`)
}

// DecodeRef parses a ref object's body. The root must be 64 lowercase hex digits.
func DecodeRef(b []byte) (casstore.Hash, error) {
	var v struct {
		Root *string `json:"root"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&v); err != nil {
		return casstore.Hash{}, fmt.Errorf("ref body %q: %w", truncate(b), err)
	}
	if v.Root == nil {
		return casstore.Hash{}, fmt.Errorf("ref body %q: no \"root\"", truncate(b))
	}
	return casstore.ParseHash(*v.Root)
}

func truncate(b []byte) string {
	if len(b) > 100 {
		return string(b[:100]) + "..."
	}
	return string(b)
}

// GetRef reads ref name with its ETag. An absent ref is an error wrapping
// errdefs.ErrNotFound.
func (r *Remote) GetRef(ctx context.Context, name string) (Ref, error) {
	if err := CheckRefName(name); err != nil {
		return Ref{}, err
	}
	start := time.Now()
	key := r.RefKey(name)
	ref, err := r.getRef(ctx, name, key)
	r.observe("get_ref", start, err)
	return ref, err
}

func (r *Remote) getRef(ctx context.Context, name, key string) (Ref, error) {
	body, info, _, err := r.core.GetObject(ctx, r.loc.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return Ref{}, r.wrap("GET", key, err)
	}
	defer body.Close()
	b, err := io.ReadAll(io.LimitReader(body, maxRefBody+1))
	if err != nil {
		return Ref{}, r.wrap("GET", key, err)
	}
	if len(b) > maxRefBody {
		return Ref{}, fmt.Errorf("remote %s: ref %s: body larger than %d bytes: %w", r.loc.url, name, maxRefBody, errdefs.ErrDataLoss)
	}
	root, err := DecodeRef(b)
	if err != nil {
		return Ref{}, fmt.Errorf("remote %s: ref %s: %w: %w", r.loc.url, name, err, errdefs.ErrDataLoss)
	}
	ref := Ref{Name: name, Root: root, ETag: info.ETag}
	if i := strings.Index(name, ConflictInfix); i > 0 {
		ref.Conflict = name[:i]
	}
	return ref, nil
}

// putRef writes a ref. match is the ETag it must still have, "*" for "must not
// exist", or "" for an unconditional write (conflict refs, as LunarFS does).
func (r *Remote) putRef(ctx context.Context, name string, root casstore.Hash, match string) error {
	key := r.RefKey(name)
	opts := minio.PutObjectOptions{ContentType: "application/json", DisableMultipart: true}
	switch match {
	case "":
	case "*":
		opts.SetMatchETagExcept("*")
	default:
		opts.SetMatchETag(strings.Trim(match, `"`))
	}
	start := time.Now()
	body := EncodeRef(root)
	_, err := r.core.Client.PutObject(ctx, r.loc.bucket, key, bytes.NewReader(body), int64(len(body)), opts)
	err = r.wrap("PUT", key, err)
	r.observe("put_ref", start, err)
	return err
}

// CASRef moves ref name to root if it still is what from says: from.ETag "" means
// the ref must not exist. On a lost race the root is kept as a conflict ref and a
// *ConflictError is returned. root must already be complete in the bucket (Push
// makes sure of it).
func (r *Remote) CASRef(ctx context.Context, name string, root casstore.Hash, from Ref) error {
	if err := CheckRefName(name); err != nil {
		return err
	}
	match := from.ETag
	if match == "" {
		match = "*"
	}
	err := r.putRef(ctx, name, root, match)
	if err == nil {
		return nil
	}
	if !errdefs.IsFailedPrecondition(err) {
		return err
	}
	// Lost: find out to what, unless the winner is ourselves (a retried PUT that had
	// in fact landed).
	cur, gerr := r.GetRef(ctx, name)
	switch {
	case gerr == nil && cur.Root == root:
		return nil
	case gerr != nil && !errdefs.IsNotFound(gerr):
		return fmt.Errorf("ref %s moved, and reading it back failed: %w", name, gerr)
	}
	return r.conflict(ctx, name, root, from.Root, cur.Root)
}

func (r *Remote) conflict(ctx context.Context, name string, pushed, expected, current casstore.Hash) error {
	cname := ConflictName(name, pushed)
	if err := r.putRef(ctx, cname, pushed, ""); err != nil {
		return fmt.Errorf("ref %s moved and writing conflict ref %s failed: %w", name, cname, err)
	}
	r.metrics.casConflicts.Add(1)
	return &ConflictError{Ref: name, Pushed: pushed, Current: current, Expected: expected, ConflictRef: cname}
}

// ListRefs lists every ref (conflict refs included) with its root, sorted by name.
// Keys below ref/ that are not valid ref names are skipped.
func (r *Remote) ListRefs(ctx context.Context) ([]Ref, error) {
	start := time.Now()
	prefix := r.loc.prefix + "ref/"
	var names []string
	var err error
	for obj := range r.core.Client.ListObjects(ctx, r.loc.bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		if obj.Err != nil {
			err = r.wrap("LIST", prefix, obj.Err)
			break
		}
		n := strings.TrimPrefix(obj.Key, prefix)
		if CheckRefName(n) == nil {
			names = append(names, n)
		}
	}
	r.observe("list_refs", start, err)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	refs := make([]Ref, 0, len(names))
	for _, n := range names {
		ref, err := r.GetRef(ctx, n)
		if errdefs.IsNotFound(err) {
			continue // removed since the listing
		}
		if err != nil {
			return nil, err
		}
		refs = append(refs, ref)
	}
	return refs, nil
}

// DeleteRef removes ref name. Its objects stay (other refs may share them). An absent
// ref is an error wrapping errdefs.ErrNotFound.
func (r *Remote) DeleteRef(ctx context.Context, name string) error {
	if _, err := r.GetRef(ctx, name); err != nil {
		return err
	}
	start := time.Now()
	key := r.RefKey(name)
	err := r.wrap("DELETE", key, r.core.Client.RemoveObject(ctx, r.loc.bucket, key, minio.RemoveObjectOptions{}))
	r.observe("delete_ref", start, err)
	return err
}

// ResolveRef reads ref name's root.
func (r *Remote) ResolveRef(ctx context.Context, name string) (casstore.Hash, error) {
	ref, err := r.GetRef(ctx, name)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return casstore.Hash{}, fmt.Errorf("remote %s: no ref %q: %w", r.loc.url, name, errdefs.ErrNotFound)
		}
		return casstore.Hash{}, err
	}
	return ref.Root, nil
}

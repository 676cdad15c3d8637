package casstore

import (
	"bytes"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/internal/vectors"
)

func mustHash(t testing.TB, s string) Hash {
	t.Helper()
	h, err := ParseHash(s)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestEmptyHashPinned(t *testing.T) {
	if got := EmptyHash.String(); got != "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262" {
		t.Fatalf("H(\"\") = %s", got)
	}
}

func TestTreeVectors(t *testing.T) {
	v, err := vectors.Load()
	if err != nil {
		t.Fatal(err)
	}
	if v.EmptyHash != EmptyHash.String() {
		t.Fatalf("vector empty hash %s != %s", v.EmptyHash, EmptyHash)
	}
	if len(v.Trees) == 0 {
		t.Fatal("no tree vectors")
	}
	for _, tv := range v.Trees {
		t.Run(tv.ID, func(t *testing.T) {
			var entries []Entry
			for _, e := range tv.Entries {
				entries = append(entries, Entry{Mode: Mode(e.Mode), Name: e.Name, Hash: mustHash(t, e.Hash)})
			}
			got, err := EncodeTree(entries)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := hex.DecodeString(tv.BytesHex)
			if !bytes.Equal(got, want) {
				t.Fatalf("bytes\n got %x\nwant %x", got, want)
			}
			if h := Sum(got); h.String() != tv.Hash {
				t.Fatalf("hash %s, want %s", h, tv.Hash)
			}
			back, err := DecodeTree(want)
			if err != nil {
				t.Fatal(err)
			}
			if len(back) != len(entries) {
				t.Fatalf("decoded %d entries, want %d", len(back), len(entries))
			}
			for _, e := range entries {
				if d, ok := back.Lookup(e.Name); !ok || d != e {
					t.Fatalf("lookup %q = %+v, %v; want %+v", e.Name, d, ok, e)
				}
			}
		})
	}
}

func rawEntry(mode uint32, name string, h byte) []byte {
	b := []byte{byte(mode), byte(mode >> 8), byte(mode >> 16), byte(mode >> 24), byte(len(name)), 0, 0, 0}
	b = append(b, name...)
	return append(b, bytes.Repeat([]byte{h}, HashSize)...)
}

func TestDecodeRefusesDangerousTrees(t *testing.T) {
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	cases := map[string]struct {
		data []byte
		want string
	}{
		"dotdot":        {rawEntry(0x81a4, "..", 1), `".."`},
		"dot":           {rawEntry(0x81a4, ".", 1), `"."`},
		"escaping":      {rawEntry(0x81a4, "../x", 1), "contains '/'"},
		"slash":         {rawEntry(0x81a4, "a/b", 1), "contains '/'"},
		"nul":           {rawEntry(0x81a4, "a\x00b", 1), "NUL"},
		"empty name":    {rawEntry(0x81a4, "", 1), "empty name"},
		"bad utf8":      {rawEntry(0x81a4, "n\xffx", 1), "UTF-8"},
		"unknown mode":  {rawEntry(0o40755, "a", 1), "unknown mode"},
		"duplicate":     {cat(rawEntry(0x81a4, "a", 1), rawEntry(0x81a4, "a", 2)), "duplicate"},
		"out of order":  {cat(rawEntry(0x81a4, "b", 1), rawEntry(0x81a4, "a", 2)), "out of order"},
		"short header":  {[]byte{0xa4, 0x81, 0}, "truncated"},
		"short hash":    {rawEntry(0x81a4, "a", 1)[:20], "runs past the end"},
		"huge name len": {[]byte{0xa4, 0x81, 0, 0, 0xff, 0xff, 0xff, 0xff}, "runs past the end"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeTree(c.data)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want mention of %q", err, c.want)
			}
		})
	}
}

func TestEncodeIsStrict(t *testing.T) {
	for _, name := range []string{"", ".", "..", "a/b", "a\x00", "\xff"} {
		if _, err := EncodeTree([]Entry{{Mode: ModeFile, Name: name}}); !errors.Is(err, ErrBadName) {
			t.Errorf("EncodeTree(%q) err = %v, want ErrBadName", name, err)
		}
	}
	if _, err := EncodeTree([]Entry{{Mode: ModeFile, Name: "a"}, {Mode: ModeDir, Name: "a"}}); !errors.Is(err, ErrBadName) {
		t.Errorf("duplicate names accepted: %v", err)
	}
	if _, err := EncodeTree([]Entry{{Mode: 0o100600, Name: "a"}}); err == nil {
		t.Error("unknown mode accepted")
	}
}

func TestParseHash(t *testing.T) {
	good := strings.Repeat("ab", 32)
	if _, err := ParseHash(good); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "abc", strings.ToUpper(good), "+a" + good[2:], good + "0", strings.Repeat("g", 64)} {
		if _, err := ParseHash(bad); err == nil || !strings.Contains(err.Error(), "malformed hash") {
			t.Errorf("ParseHash(%q) err = %v", bad, err)
		}
	}
}

// FuzzDecodeTree checks that the decoder never panics, and that whatever it accepts
// re-encodes to exactly the same bytes (one logical tree, one hash).
func FuzzDecodeTree(f *testing.F) {
	f.Add([]byte{})
	f.Add(rawEntry(0x81a4, "x", 0x42))
	f.Add(append(rawEntry(0x4000, "a", 3), rawEntry(0x81ed, "b", 4)...))
	f.Add(rawEntry(0o120000, "link", 7))
	f.Add(rawEntry(0x81a4, "../x", 1))
	f.Fuzz(func(t *testing.T, data []byte) {
		tree, err := DecodeTree(data)
		if err != nil {
			return
		}
		again, err := EncodeTree(tree)
		if err != nil {
			t.Fatalf("accepted tree does not re-encode: %v", err)
		}
		if !bytes.Equal(again, data) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", data, again)
		}
	})
}

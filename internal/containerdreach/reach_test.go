package containerdreach

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

func TestKeyOf(t *testing.T) {
	for in, want := range map[string]Key{
		"default/12/sha256:abc":    {"default", "sha256:abc"},
		"k8s.io/3/a/b/c":           {"k8s.io", "a/b/c"},
		"tph-1/5/warm-view-0":      {"tph-1", "warm-view-0"},
		"default/x/name":           {},
		"default/12/":              {},
		"/12/name":                 {},
		"default//name":            {},
		"no-slashes":               {},
		"default/12":               {},
		"default/-1/name":          {},
		"default/1 2/name":         {},
		"default/0012/name/../etc": {"default", "name/../etc"}, // a key is containerd's to judge
	} {
		got, ok := KeyOf(in)
		if ok != (want != Key{}) || got != want {
			t.Errorf("KeyOf(%q) = %+v, %v; want %+v", in, got, ok, want)
		}
	}
}

// prober answers from a script, one entry a call, and records the keys asked about.
type prober struct {
	answers []error
	asked   []Key
}

func (p *prober) Stat(ctx context.Context, k Key) error {
	p.asked = append(p.asked, k)
	if len(p.answers) == 0 {
		return nil
	}
	err := p.answers[0]
	if len(p.answers) > 1 {
		p.answers = p.answers[1:]
	}
	return err
}

var (
	backoff = fmt.Errorf("connection error: dial unix snap.sock: timeout: %w", errdefs.ErrUnavailable)
	gone    = fmt.Errorf("snapshot x does not exist: %w", errdefs.ErrNotFound)
	fast    = Options{Max: 300 * time.Millisecond, Interval: time.Millisecond, PerCall: time.Second}
	a, b    = Key{"default", "a"}, Key{"k8s.io", "b"}
)

func TestWait(t *testing.T) {
	for _, c := range []struct {
		name    string
		keys    []Key
		answers []error
		want    Outcome
		asked   int // at least
		lastB   bool
	}{
		{"no keys: nothing to wait for", nil, nil, NothingToAsk, 0, false},
		{"answered at once", []Key{a}, []error{nil}, Reached, 1, false},
		{"backoff, then answered", []Key{a}, []error{backoff, backoff, backoff, nil}, Reached, 4, false},
		{"an unknown key, then the next", []Key{a, b}, []error{gone, nil}, Reached, 2, true},
		{"no key containerd knows", []Key{a, b}, []error{gone}, NothingToAsk, 2, true},
		{"another error ends the wait", []Key{a}, []error{errors.New("boom")}, Unknown, 1, false},
		{"backoff until the longest wait", []Key{a}, []error{backoff}, TimedOut, 10, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := &prober{answers: c.answers}
			start := time.Now()
			got, _ := Wait(context.Background(), p, c.keys, fast)
			if got != c.want {
				t.Fatalf("Wait = %q, want %q", got, c.want)
			}
			if len(p.asked) < c.asked {
				t.Errorf("asked %d times, want at least %d", len(p.asked), c.asked)
			}
			if c.lastB && p.asked[len(p.asked)-1] != b {
				t.Errorf("asked %v, want the second key last", p.asked)
			}
			if took := time.Since(start); c.want == TimedOut && (took < fast.Max-fast.Interval || took > 10*fast.Max) {
				t.Errorf("timed out after %v, want about %v", took, fast.Max)
			}
		})
	}
}

func TestWaitStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &prober{answers: []error{backoff}}
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	o := fast
	o.Max, o.Interval = time.Minute, 5*time.Millisecond
	if got, err := Wait(ctx, p, []Key{a}, o); got != Unknown || !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait after cancel = %q, %v", got, err)
	}
}

package localapi

import (
	"reflect"
	"testing"
	"time"
)

func TestStepsRoundTrip(t *testing.T) {
	steps := []Step{{"take", 120 * time.Microsecond}, {"bind", 3500 * time.Microsecond}, {"commit", 2 * time.Second}}
	s := FormatSteps(steps)
	if s != "take=0.120,bind=3.500,commit=2000.000" {
		t.Fatalf("FormatSteps = %q", s)
	}
	if got := ParseSteps(s); !reflect.DeepEqual(got, steps) {
		t.Fatalf("ParseSteps = %v", got)
	}
	// Figures only inform: what cannot be read is skipped, never a failure.
	if got := ParseSteps("take=1,junk,=2,bind=x,,exec=0.5"); !reflect.DeepEqual(got, []Step{{"take", time.Millisecond}, {"exec", 500 * time.Microsecond}}) {
		t.Fatalf("ParseSteps of junk = %v", got)
	}
	if got := ParseSteps(""); got != nil {
		t.Fatalf("ParseSteps(\"\") = %v", got)
	}
}

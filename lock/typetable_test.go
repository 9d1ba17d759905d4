package lock

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
)

// freshTypes gives the test a table of the built-in types alone, with at
// most maxExtra names taken from callers, and puts the process's back at
// its end. The tests of this package that use it do not run in parallel.
func freshTypes(t *testing.T, maxExtra int) {
	t.Helper()
	typesMu.Lock()
	old, oldMax := types.Load(), maxExtraTypes
	types.Store(builtinTypes())
	maxExtraTypes = maxExtra
	typesMu.Unlock()
	t.Cleanup(func() {
		typesMu.Lock()
		types.Store(old)
		maxExtraTypes = oldMax
		typesMu.Unlock()
	})
}

func TestParseType(t *testing.T) {
	freshTypes(t, MaxExtraTypes)
	for s, want := range map[string]Type{"pull": Pull, "update": Update, "delete": Delete} {
		if got, err := ParseType(s); err != nil || got != want || got.String() != s || !got.Builtin() {
			t.Errorf("ParseType(%q) = %v, %v", s, got, err)
		}
	}
	layer, err := ParseType("image-layer")
	if err != nil {
		t.Fatal(err)
	}
	if !layer.Valid() || layer.Builtin() || layer.String() != "image-layer" {
		t.Fatalf("image-layer: %d %v valid=%v builtin=%v", layer, layer, layer.Valid(), layer.Builtin())
	}
	if again, err := ParseType(strings.Clone("image-layer")); err != nil || again != layer {
		t.Fatalf("a name parsed twice: %v then %v, %v", layer, again, err)
	}
	if got, ok := LookupType("image-layer"); !ok || got != layer {
		t.Fatalf("LookupType(image-layer) = %v, %v", got, ok)
	}
	if _, ok := LookupType("never-seen"); ok {
		t.Fatal("LookupType made a type")
	}
	if max := strings.Repeat("a", MaxTypeLen); mustParse(t, max).String() != max {
		t.Fatalf("a name of %d bytes", MaxTypeLen)
	}
	for _, bad := range []string{"", "Pull", "PULL", "1abc", "-x", "a_b", "a.b", "a/b", "a b", "é", "a\x00",
		strings.Repeat("a", MaxTypeLen+1), "layer:1", "image-layer\n"} {
		if ty, err := ParseType(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseType(%q) = %v, %v; want ErrInvalid", bad, ty, err)
		}
		if _, err := InternType(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("InternType(%q): %v, want ErrInvalid", bad, err)
		}
	}
	for _, ty := range []Type{0, Type(len(types.Load().names)), 255} {
		if ty.Valid() || ValidateKey(ty, "r", "n") == nil || !strings.HasPrefix(ty.String(), "Type(") {
			t.Errorf("Type %d is valid, or names %q", ty, ty.String())
		}
	}
}

func mustParse(t *testing.T, s string) Type {
	t.Helper()
	ty, err := ParseType(s)
	if err != nil {
		t.Fatal(err)
	}
	return ty
}

// TestTooManyTypes: callers bring MaxExtraTypes names, the next is refused
// with ErrTooManyTypes, not ErrInvalid, and every name taken still works;
// names read back from storage go on up to MaxTypes.
func TestTooManyTypes(t *testing.T) {
	freshTypes(t, MaxExtraTypes)
	var taken []Type
	for i := range MaxExtraTypes {
		taken = append(taken, mustParse(t, fmt.Sprintf("t%d", i)))
	}
	refused := RefusedTypes()
	_, err := ParseType("one-more")
	if !errors.Is(err, ErrTooManyTypes) || errors.Is(err, ErrInvalid) {
		t.Fatalf("name %d: %v, want ErrTooManyTypes", MaxExtraTypes+1, err)
	}
	if got := RefusedTypes(); got != refused+1 {
		t.Fatalf("RefusedTypes %d after a refusal, was %d", got, refused)
	}
	for _, word := range []string{"timeout", "connection", "network", "EOF", "refused"} {
		if strings.Contains(err.Error(), word) {
			t.Errorf("message %q contains %q: the seeds' client would retry it", err, word)
		}
	}
	if _, ok := LookupType("one-more"); ok {
		t.Fatal("a refused name was kept")
	}
	for i, ty := range taken {
		if got := mustParse(t, fmt.Sprintf("t%d", i)); got != ty {
			t.Fatalf("t%d: %v, was %v", i, got, ty)
		}
	}
	// A name another server took and put in storage.
	stored, err := InternType("one-more")
	if err != nil || stored.String() != "one-more" || mustParse(t, "one-more") != stored {
		t.Fatalf("InternType past the callers' bound: %v, %v", stored, err)
	}
	for i := 0; ; i++ {
		ty, err := InternType(fmt.Sprintf("s%d", i))
		if err != nil {
			if !errors.Is(err, ErrTooManyTypes) || len(types.Load().names) != MaxTypes+1 {
				t.Fatalf("InternType %d: %v with %d names", i, err, len(types.Load().names))
			}
			break
		}
		if ty == 0 || int(ty) > MaxTypes {
			t.Fatalf("InternType %d gave %d", i, ty)
		}
	}
	if ty := Type(MaxTypes); !ty.Valid() || ty.String() == "" {
		t.Fatalf("the last type: %v", ty)
	}
}

// TestParseTypeRace: goroutines taking the same and different names at once
// agree on each name's Type, and no two names share one.
func TestParseTypeRace(t *testing.T) {
	freshTypes(t, MaxExtraTypes)
	const goroutines, names = 8, 20
	got := make([][]Type, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range names {
				n := (i + g) % names // each goroutine in its own order
				ty, err := ParseType(fmt.Sprintf("race-%d", n))
				if err != nil {
					t.Error(err)
					return
				}
				if got[g] == nil {
					got[g] = make([]Type, names)
				}
				got[g][n] = ty
				_ = ty.String() // read while others write
			}
		})
	}
	wg.Wait()
	for g := 1; g < goroutines; g++ {
		if !slices.Equal(got[g], got[0]) {
			t.Fatalf("goroutine %d: %v, goroutine 0: %v", g, got[g], got[0])
		}
	}
	seen := map[Type]bool{}
	for n, ty := range got[0] {
		if seen[ty] || ty.String() != fmt.Sprintf("race-%d", n) {
			t.Fatalf("race-%d is %d (%v)", n, ty, ty)
		}
		seen[ty] = true
	}
}

// TestCompareTypes: the built-in types first in their order, then the
// others by name, whichever numbers the process gave them.
func TestCompareTypes(t *testing.T) {
	freshTypes(t, MaxExtraTypes)
	z, a := mustParse(t, "zz"), mustParse(t, "aa") // numbered against their names' order
	got := []Type{z, Delete, a, Pull, Update}
	slices.SortFunc(got, CompareTypes)
	if want := []Type{Pull, Update, Delete, a, z}; !slices.Equal(got, want) {
		t.Fatalf("sorted %v, want %v", got, want)
	}
}

// BenchmarkParseType: what a request pays to parse its type, built in or
// not, and what an event or an etcd key pays to name it.
func BenchmarkParseType(b *testing.B) {
	layer, err := ParseType("image-layer")
	if err != nil {
		b.Fatal(err)
	}
	for _, name := range []string{"pull", "delete", "image-layer"} {
		b.Run("parse "+name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ParseType(name); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	for _, t := range []Type{Pull, layer} {
		b.Run("name "+t.String(), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = t.String()
			}
		})
	}
}

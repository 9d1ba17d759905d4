package lock

import (
	"maps"
	"slices"
	"testing"
)

func TestRefRules(t *testing.T) {
	for _, tc := range []struct {
		t       Type
		count   int
		updReq  bool
		wantErr bool
	}{
		{Pull, 5, true, false}, {Delete, 0, false, false}, {Delete, 1, false, true},
		{Update, 1, false, false}, {Update, 1, true, true}, {Update, 0, true, false},
	} {
		if err := RefPermits(tc.t, tc.count, tc.updReq); (err != nil) != tc.wantErr {
			t.Errorf("RefPermits(%v, %d, %v) = %v", tc.t, tc.count, tc.updReq, err)
		}
	}
	want := map[Type][2]RefEffect{Pull: {RefNone, RefAddNode}, Update: {RefNone, RefNone}, Delete: {RefNone, RefClear}}
	for _, typ := range slices.Sorted(maps.Keys(want)) {
		for i, success := range []bool{false, true} {
			if got := RefEffectOf(typ, success); got != want[typ][i] {
				t.Errorf("RefEffectOf(%v, %v) = %v", typ, success, got)
			}
		}
	}
}

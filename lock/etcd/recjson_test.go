package etcd

import (
	"encoding/json"
	"reflect"
	"testing"
)

// recordSeeds are records as encode makes them, every field set in some.
func recordSeeds() []keyRec {
	return []keyRec{
		{},
		{Holder: "node-17", Token: 1234567, Lease: 2, Acquired: 1764190000000000000, TTL: 1764190030000000000},
		{Holder: "hs-1", Token: 9, Lease: 1, SLease: 7587889123456789012, X: &trans{Assigned: "hs-1"}},
		{Token: 18446744073709551615, Queue: 3, Seq: 9, WaitTTL: -1, Delay: -9223372036854775808, Claim: 5, MaxHold: 9223372036854775807, Lease: 255,
			Done: &done{Node: "a<b>&c", Token: 3, OK: true, Err: "x\"y\\", At: 7, Next: "n", Unlock: true},
			X:    &trans{Done: &done{Node: "a", Token: 3}, Skip: true, Left: true, Refused: []string{"p", "", "\u00e9\u2028"}, At: 8}},
	}
}

// FuzzRecordMatchesJSON holds decodeKey, whose fastKey reads the records
// encode makes without encoding/json, to encoding/json's answer for any
// bytes: the same record, or an error exactly when encoding/json gives one.
// Every server must read a record as every other does.
func FuzzRecordMatchesJSON(f *testing.F) {
	for _, r := range recordSeeds() {
		f.Add([]byte(encode(&r)))
	}
	for _, s := range []string{
		`{`, `null`, `[]`, `{}`, `{"h":1}`, `{"H":"caps"}`, `{"h":"a","h":"b"}`, `{"h":"a","H":"b"}`, `{"t":-1}`,
		`{"t":1e3}`, `{"t":1.0}`, `{"t":01}`, `{"t":-0}`, `{"at":-0}`, `{"at":-9223372036854775809}`,
		`{"t":18446744073709551616}`, `{"l":256}`, `{"q":9223372036854775808}`, `{"c":null}`, `{"h":null}`,
		`{"x":{"r":null}}`, `{"x":{"r":[]}}`, `{"x":{"r":["a",1]}}`, `{"x":{"r":["a" ,"b"]}}`, `{"h":"\ud800"}`,
		"{\"h\":\"\xff\"}", "{\"h\":\"a\x7fb\"}", "{\"h\":\"a\tb\"}", `{"h":"a"} x`, ` {"t":1} `, `{"t":1 }`,
		`{"at":"1"}`, `{"unknown":{"deep":[1,2,{}]}}`, `{"c":{"ok":"true"}}`, `{"c":{"ok":tru}}`,
		`{"c":{"ok":false,"u":true}}`, `{"c":{}}`, `{"x":{}}`, `{"c":{"n":"a","n":"b"}}`, `{"x":{"c":{"zz":1}}}`,
		`{"h":"\u0041"}`, `{"h":"a\/b"}`, `{"s":1,}`, `{,}`, `{"t"1}`, `{"x":{"ix":true,"k":true}}`, `{"x":{"ix":1}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) == 0 || b[0] == compactTag {
			return // no record, and the cache's own form: not JSON
		}
		var want keyRec
		werr := json.Unmarshal(b, &want)
		got, err := decodeKey(b)
		if (err == nil) != (werr == nil) {
			t.Fatalf("%q: decodeKey's error %v, encoding/json's %v", b, err, werr)
		}
		if err == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: decodeKey read %+v, encoding/json %+v", b, got, want)
		}
	})
}

// TestFastKeyReadsEncode: the records encode makes of printable ASCII are
// read by fastKey itself, not left to encoding/json (else the fuzz test
// above would hold nothing).
func TestFastKeyReadsEncode(t *testing.T) {
	for _, r := range recordSeeds()[:3] {
		b := []byte(encode(&r))
		got, ok := fastKey(b)
		if !ok || !reflect.DeepEqual(got, r) {
			t.Errorf("%s: fastKey read %+v (%v)", b, got, ok)
		}
	}
}

func BenchmarkDecodeKey(b *testing.B) {
	r := recordSeeds()[1]
	r.Done = &done{Node: "node-3", Token: 1234566, OK: true, At: 1764189999000000000, Unlock: true}
	r.X = &trans{Assigned: r.Holder, Done: r.Done}
	raw := []byte(encode(&r))
	b.Run("decodeKey", func(b *testing.B) {
		for b.Loop() {
			if _, err := decodeKey(raw); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		for b.Loop() {
			var r keyRec
			if err := json.Unmarshal(raw, &r); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// FuzzSessionMatchesJSON holds decodeSess, whose fastSess reads the session
// records encodeSess makes without encoding/json, to encoding/json's answer
// for any bytes, and encodeSess to encode for any record read.
func FuzzSessionMatchesJSON(f *testing.F) {
	for _, r := range []sessRec{{}, {Lease: 1}, {Lease: 7587889123456789012, Home: 1234567}, {Lease: -1, Home: -9223372036854775808}, {Lease: 9223372036854775807}} {
		f.Add([]byte(encode(r)))
	}
	for _, s := range []string{
		`{`, `null`, `[]`, `{}`, `{"l":1,"l":2}`, `{"L":3}`, `{"l":1,"H":2}`, `{"l":-0}`, `{"l":01}`, `{"l":1e3}`,
		`{"l":1.0}`, `{"l":9223372036854775808}`, `{"l":-9223372036854775809}`, `{"l":"1"}`, `{"l":null}`,
		`{"l":1,"x":{"y":[1]}}`, ` {"l":1}`, `{"l":1} `, `{"l":1,}`, `{"h":5}`, `{"l" :1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want sessRec
		werr := json.Unmarshal(b, &want)
		got, err := decodeSess(b)
		if (err == nil) != (werr == nil) {
			t.Fatalf("%q: decodeSess's error %v, encoding/json's %v", b, err, werr)
		}
		if err != nil {
			return
		}
		if got != want {
			t.Fatalf("%q: decodeSess read %+v, encoding/json %+v", b, got, want)
		}
		if e, w := encodeSess(got), encode(got); e != w {
			t.Fatalf("%+v: encodeSess made %s, encode %s", got, e, w)
		}
	})
}

// TestFastSessReadsEncode: the records encodeSess makes are read by
// fastSess itself, not left to encoding/json.
func TestFastSessReadsEncode(t *testing.T) {
	for _, r := range []sessRec{{Lease: 1}, {Lease: 7587889123456789012, Home: 1234567}, {Lease: -5, Home: -9223372036854775808}} {
		b := []byte(encodeSess(r))
		got, ok := fastSess(b)
		if !ok || got != r {
			t.Errorf("%s: fastSess read %+v (%v)", b, got, ok)
		}
	}
}

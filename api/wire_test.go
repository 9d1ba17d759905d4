package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

var badBodies = []string{
	``, `   `, `null`, `[]`, `{`, `{"type":"pull"`, `{"type":1}`,
	`{"type":"Fetch","resource_id":"r","node_id":"a"}`,
	`{"type":"image_layer","resource_id":"r","node_id":"a"}`,
	`{"type":"` + strings.Repeat("x", 33) + `","resource_id":"r","node_id":"a"}`,
	`{"type":"pull","resource_id":"","node_id":"a"}`,
	`{"type":"pull","resource_id":"r","node_id":""}`,
	`{"type":"pull","resource_id":"r\n","node_id":"a"}`,
	`{"type":"pull","resource_id":"r","node_id":"a","lease":"x"}`,
	`{"type":"pull","resource_id":"r","node_id":"a"} {}`,
	`{"type":"pull","resource_id":"r","node_id":"a","success":"yes"}`,
	`{"type":"pull","resource_id":"r","node_id":"a","token":-1}`,
	`{"type":"pull","resource_id":"` + strings.Repeat("x", 513) + `","node_id":"a"}`,
}

func TestParseRejects(t *testing.T) {
	for _, b := range badBodies {
		if _, err := ParseLock([]byte(b)); err == nil && !strings.Contains(b, "success") && !strings.Contains(b, "token") {
			t.Errorf("ParseLock(%q) accepted", b)
		} else if err != nil && !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("ParseLock(%q) = %v, not ErrInvalid", b, err)
		}
	}
	if _, err := ParseUnlock([]byte(`{"type":"pull","resource_id":"r","node_id":"a","success":"yes"}`)); err == nil || !strings.Contains(err.Error(), "success") {
		t.Errorf("ParseUnlock with a string success: %v, want an error naming the field", err)
	}
}

func TestParseUnlockSuccessDefault(t *testing.T) {
	for body, want := range map[string]bool{
		`{"type":"pull","resource_id":"r","node_id":"a"}`:                                true,
		`{"type":"pull","resource_id":"r","node_id":"a","error":"x"}`:                    false,
		`{"type":"pull","resource_id":"r","node_id":"a","error":"x","success":true}`:     true,
		`{"type":"pull","resource_id":"r","node_id":"a","success":false,"timestamp":12}`: false,
	} {
		r, err := ParseUnlock([]byte(body))
		if err != nil || r.Success != want {
			t.Errorf("ParseUnlock(%s) = %+v %v, want success %v", body, r, err, want)
		}
	}
}

func TestErrorsRoundTrip(t *testing.T) {
	for _, err := range []error{lock.ErrInvalid, lock.ErrTooManyTypes, lock.ErrNotHolder, lock.ErrStaleToken, lock.ErrInUse, lock.ErrDeleting, lock.ErrUpdating, &lock.HeldError{Holder: "n1"}, ErrNotFound} {
		status, body := ErrorResponse(err)
		back := ErrorFromResponse(status, body)
		if !errors.Is(back, errors.Unwrap(err)) && !errors.Is(back, err) {
			t.Errorf("%v → %d %+v → %v: not errors.Is", err, status, body, back)
		}
		var ae *Error
		if !errors.As(back, &ae) || ae.Status != status || ae.Code != body.Code {
			t.Errorf("%v → %v: errors.As *api.Error gives %+v, want status %d code %s", err, back, ae, status, body.Code)
		}
		for _, word := range []string{"timeout", "connection", "network", "EOF", "refused"} {
			if status < 500 && strings.Contains(body.Error, word) {
				t.Errorf("4xx message %q contains %q: old clients would retry it", body.Error, word)
			}
		}
	}
	var held *lock.HeldError
	if status, body := ErrorResponse(&lock.HeldError{Holder: "n1"}); !errors.As(ErrorFromResponse(status, body), &held) || held.Holder != "n1" {
		t.Errorf("lock_held lost its holder: %+v", held)
	}
	if status, body := ErrorResponse(errors.New("disk on fire")); status != http.StatusInternalServerError || body.Code != CodeInternal {
		t.Errorf("unknown error: %d %+v", status, body)
	}
	if _, err := ParseLock([]byte(`{"type":"pull"`)); strings.Contains(err.Error(), "EOF") {
		t.Errorf("truncated JSON error %q mentions EOF", err)
	}
}

func FuzzParseLock(f *testing.F) {
	fuzzParser(f, `{"type":"pull","resource_id":"sha256:abc","node_id":"n1","lease":"ttl","skip_recent":true}`, ParseLock)
}

func FuzzParseUnlock(f *testing.F) {
	fuzzParser(f, `{"type":"delete","resource_id":"r","node_id":"n","success":false,"error":"x","token":7}`, ParseUnlock)
}

// fuzzParser: a parser never panics, fails only with ErrInvalid (or
// ErrTooManyTypes, once the fuzzer's names fill the table), and never
// accepts a request that does not validate.
func fuzzParser[R interface{ Validate() error }](f *testing.F, good string, parse func([]byte) (R, error)) {
	for _, b := range badBodies {
		f.Add([]byte(b))
	}
	f.Add([]byte(good))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := parse(data)
		if err != nil {
			// The fuzzer's type names fill the process's table of them.
			if !errors.Is(err, lock.ErrInvalid) && !errors.Is(err, lock.ErrTooManyTypes) {
				t.Fatalf("error %v is neither ErrInvalid nor ErrTooManyTypes", err)
			}
			return
		}
		if r.Validate() != nil {
			t.Fatalf("accepted an invalid request %+v", r)
		}
	})
}

// FuzzFastMatchesJSON holds the reflection-free parser to encoding/json:
// whatever it accepts, encoding/json decodes to the same values.
func FuzzFastMatchesJSON(f *testing.F) {
	for _, b := range badBodies {
		f.Add([]byte(b))
	}
	f.Add([]byte(`{"type":"pull","resource_id":"sha256:abc","node_id":"n1","lease":"ttl","skip_recent":true}`))
	f.Add([]byte(` { "type" : "delete" , "resource_id":"r","node_id":"n","success":false,"error":"x","token":7 } `))
	f.Add([]byte(`{"type":"pull","type":"delete"}`))
	f.Add([]byte(`{"token":007}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		fast, ok := parseFast(data)
		if !ok {
			return
		}
		var slow struct {
			Type       string `json:"type"`
			ResourceID string `json:"resource_id"`
			NodeID     string `json:"node_id"`
			Lease      string `json:"lease"`
			SkipRecent bool   `json:"skip_recent"`
			Success    *bool  `json:"success"`
			Error      string `json:"error"`
			Token      uint64 `json:"token"`
		}
		if err := json.Unmarshal(data, &slow); err != nil {
			t.Fatalf("fast path accepted %q, encoding/json says %v", data, err)
		}
		if fast.typ != slow.Type || fast.resource != slow.ResourceID || fast.node != slow.NodeID || fast.lease != slow.Lease ||
			fast.skipRecent != slow.SkipRecent || fast.errMsg != slow.Error || fast.token != slow.Token ||
			fast.hasSuccess != (slow.Success != nil) || (slow.Success != nil && *slow.Success != fast.success) {
			t.Fatalf("%q: fast %+v, encoding/json %+v", data, fast, slow)
		}
	})
}

func TestFastPathTaken(t *testing.T) {
	if _, ok := parseFast([]byte(`{"type":"pull","resource_id":"sha256:abc","node_id":"n1"}`)); !ok {
		t.Fatal("the common /lock body is not parsed by the fast path")
	}
	if _, ok := parseFast([]byte(`{"type":"pull","resource_id":"a\u0062","node_id":"n1"}`)); ok {
		t.Fatal("an escaped string took the fast path")
	}
}

// TestParseAllocs: the fast path allocates the two identifiers it returns
// and nothing else; the type and the lease are constants.
func TestParseAllocs(t *testing.T) {
	lockBody := []byte(`{"type":"pull","resource_id":"r1","node_id":"n1","lease":"ttl"}`)
	unlockBody := []byte(`{"type":"update","resource_id":"r1","node_id":"n1","success":true,"token":7}`)
	for name, f := range map[string]func(){
		"ParseLock":   func() { _, _ = ParseLock(lockBody) },
		"ParseUnlock": func() { _, _ = ParseUnlock(unlockBody) },
	} {
		if n := testing.AllocsPerRun(100, f); n > 2 {
			t.Errorf("%s: %v allocations, want 2 at most (resource_id and node_id)", name, n)
		}
	}
}

// TestAppendLockResponseMatchesJSON holds the hand-written encoder of the
// hot path to encoding/json, with and without a guarantee.
func TestAppendLockResponseMatchesJSON(t *testing.T) {
	for _, r := range []LockResponse{
		{},
		{Acquired: true, Token: 7, Holder: "n1", GuaranteedMs: Millis(4999 * time.Millisecond)},
		{Acquired: true, Token: 1<<64 - 1, Holder: "n\"1\u2028", GuaranteedMs: Millis(0)},
		{Queued: true, Holder: "h", Position: 3},
		{Skip: true},
		{Acquired: true, Token: 1, Holder: "n", GuaranteedMs: Guarantee{Ms: -5, Set: true}},
	} {
		want, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if got := AppendLockResponse(nil, r); string(got) != string(want) {
			t.Errorf("AppendLockResponse = %s, encoding/json = %s", got, want)
		}
	}
	// Decoding tells an absent guarantee from 0.
	for in, want := range map[string]Guarantee{`{}`: {}, `{"guaranteed_ms":0}`: {Ms: 0, Set: true}, `{"guaranteed_ms":4999}`: {Ms: 4999, Set: true}, `{"guaranteed_ms":null}`: {}} {
		var r LockResponse
		if err := json.Unmarshal([]byte(in), &r); err != nil || r.GuaranteedMs != want {
			t.Errorf("%s decodes to %+v (%v), want %+v", in, r.GuaranteedMs, err, want)
		}
	}
	if got := Millis(1999999 * time.Microsecond).Ms; got != 1999 {
		t.Errorf("Millis(1.999999s) = %d, want 1999: a guarantee is rounded down", got)
	}
}

// TestParseOtherTypes: a type besides pull, update and delete (the seeds'
// content layer sends image-layer) parses on every path, fast and slow, and
// its events carry its name.
func TestParseOtherTypes(t *testing.T) {
	layer, err := lock.ParseType("image-layer")
	if err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{
		`{"type":"image-layer","resource_id":"sha256:abc","node_id":"n1"}`,
		`{"type":"image-layer","resource_id":"sha256:\u0061bc","node_id":"n1","timestamp":1}`, // encoding/json's path
	} {
		r, err := ParseLock([]byte(body))
		if err != nil || r.Type != layer || r.Resource != "sha256:abc" {
			t.Errorf("ParseLock(%s) = %+v, %v", body, r, err)
		}
		u, err := ParseUnlock([]byte(body))
		if err != nil || u.Type != layer || !u.Success {
			t.Errorf("ParseUnlock(%s) = %+v, %v", body, u, err)
		}
		k, node, err := ParseKey([]byte(body))
		if err != nil || k.Type != layer || node != "n1" {
			t.Errorf("ParseKey(%s) = %v %q, %v", body, k, node, err)
		}
	}
	for _, ev := range []*lock.Event{
		{Name: lock.EventLockAssigned, Key: lock.Key{Type: layer, Resource: "r"}, Node: "n1", Token: 7},
		{Name: lock.EventOperationCompleted, Key: lock.Key{Type: layer, Resource: "r"}, Node: "n1", Success: true, CompletedAt: time.Unix(1, 0)},
	} {
		var got Event
		if err := json.Unmarshal(AppendEventData(nil, ev), &got); err != nil || got.Type != "image-layer" || got.Event != ev.Name {
			t.Errorf("%s event decodes to %+v, %v", ev.Name, got, err)
		}
	}
	if st := Status(lock.Status{Key: lock.Key{Type: layer, Resource: "r"}}, ""); st.Type != "image-layer" {
		t.Errorf("status of an image-layer key says type %q", st.Type)
	}
	status, body := ErrorResponse(fmt.Errorf("wrapped: %w", lock.ErrTooManyTypes))
	if status != http.StatusBadRequest || body.Code != CodeTooManyTypes || RetryAfter(lock.ErrTooManyTypes) != 0 {
		t.Errorf("too many types: %d %+v, Retry-After %d; want a 400 too_many_types without one", status, body, RetryAfter(lock.ErrTooManyTypes))
	}
}

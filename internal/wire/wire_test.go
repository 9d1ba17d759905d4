package wire

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/dlock/dlock/lock"
)

var badBodies = []string{
	``, `   `, `null`, `[]`, `{`, `{"type":"pull"`, `{"type":1}`,
	`{"type":"fetch","resource_id":"r","node_id":"a"}`,
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
	for _, err := range []error{lock.ErrInvalid, lock.ErrNotHolder, lock.ErrStaleToken, lock.ErrInUse, lock.ErrDeleting, lock.ErrUpdating, &lock.HeldError{Holder: "n1"}, ErrNotFound} {
		status, body := ErrorBody(err)
		back := ErrorFor(status, body)
		if !errors.Is(back, errors.Unwrap(err)) && !errors.Is(back, err) {
			t.Errorf("%v → %d %+v → %v: not errors.Is", err, status, body, back)
		}
		for _, word := range []string{"timeout", "connection", "network", "EOF", "refused"} {
			if status < 500 && strings.Contains(body.Error, word) {
				t.Errorf("4xx message %q contains %q: old clients would retry it", body.Error, word)
			}
		}
	}
	if status, body := ErrorBody(errors.New("disk on fire")); status != http.StatusInternalServerError || body.Code != CodeInternal {
		t.Errorf("unknown error: %d %+v", status, body)
	}
	if _, err := ParseLock([]byte(`{"type":"pull"`)); strings.Contains(err.Error(), "EOF") {
		t.Errorf("truncated JSON error %q mentions EOF", err)
	}
}

func FuzzParseLock(f *testing.F) {
	for _, b := range badBodies {
		f.Add([]byte(b))
	}
	f.Add([]byte(`{"type":"pull","resource_id":"sha256:abc","node_id":"n1","lease":"ttl","skip_recent":true}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseLock(data)
		if err != nil {
			if !errors.Is(err, lock.ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		if r.Validate() != nil {
			t.Fatalf("accepted an invalid request %+v", r)
		}
	})
}

func FuzzParseUnlock(f *testing.F) {
	for _, b := range badBodies {
		f.Add([]byte(b))
	}
	f.Add([]byte(`{"type":"delete","resource_id":"r","node_id":"n","success":false,"error":"x","token":7}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseUnlock(data)
		if err != nil {
			if !errors.Is(err, lock.ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		if r.Validate() != nil {
			t.Fatalf("accepted an invalid request %+v", r)
		}
	})
}

// Package wire is dlock's HTTP wire format (docs/API.md): request and response
// bodies, the parsing and validation of requests, event encoding, and the one
// table that maps errors to status codes and codes back to errors, shared by
// the server and the client so an error crosses the wire errors.Is-able.
package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/dlock/dlock/lock"
)

// EpochHeader carries the server's epoch on every response.
const EpochHeader = "Dlock-Epoch"

// PingHeader carries, on a /subscribe answer, the longest the stream stays
// silent, in milliseconds: a client that hears nothing for twice that
// takes the server for hung or cut off (docs/API.md).
const PingHeader = "Dlock-Ping-Ms"

// MaxBody is the largest request body accepted.
const MaxBody = 64 << 10

// LockRequest is the body of POST /lock.
type LockRequest struct {
	Type       string `json:"type"`
	ResourceID string `json:"resource_id"`
	NodeID     string `json:"node_id"`
	Lease      string `json:"lease,omitempty"`
	SkipRecent bool   `json:"skip_recent,omitempty"`
}

// LockResponse is the 200 answer of POST /lock.
type LockResponse struct {
	Acquired bool   `json:"acquired"`
	Queued   bool   `json:"queued"`
	Skip     bool   `json:"skip"`
	Token    uint64 `json:"token"`
	Holder   string `json:"holder"`
	Position int    `json:"position"`
	// GuaranteedMs, on a grant, is how many milliseconds from when the
	// server handled the request the hold is sure to stand (docs/API.md);
	// 0 when the server cannot vouch for it. Absent from a server that
	// predates it.
	GuaranteedMs Guarantee `json:"guaranteed_ms,omitzero"`
}

// UnlockRequest is the body of POST /unlock. Success absent means
// success = (Error == "").
type UnlockRequest struct {
	Type       string `json:"type"`
	ResourceID string `json:"resource_id"`
	NodeID     string `json:"node_id"`
	Success    *bool  `json:"success,omitempty"`
	Error      string `json:"error,omitempty"`
	Token      uint64 `json:"token,omitempty"`
}

// UnlockResponse is the 200 answer of POST /unlock.
type UnlockResponse struct {
	Released   bool   `json:"released"`
	NextHolder string `json:"next_holder"`
	Replayed   bool   `json:"replayed,omitempty"`
}

// KeyRequest is the body of POST /cancel.
type KeyRequest struct {
	Type       string `json:"type"`
	ResourceID string `json:"resource_id"`
	NodeID     string `json:"node_id"`
}

// CancelResponse is the 200 answer of POST /cancel.
type CancelResponse struct {
	Dequeued bool `json:"dequeued"`
	Released bool `json:"released"`
}

// Completion is a retained completion record.
type Completion struct {
	NodeID      string    `json:"node_id"`
	Token       uint64    `json:"token"`
	Success     bool      `json:"success"`
	Error       string    `json:"error"`
	CompletedAt time.Time `json:"completed_at"`
}

// StatusResponse is the answer of GET /status.
type StatusResponse struct {
	Type          string      `json:"type"`
	ResourceID    string      `json:"resource_id"`
	State         string      `json:"state"`
	Holder        string      `json:"holder"`
	Token         uint64      `json:"token"`
	AcquiredAt    string      `json:"acquired_at"`
	QueueLength   int         `json:"queue_length"`
	Position      int         `json:"position"`
	LastCompleted *Completion `json:"last_completed"`
	// GuaranteedMs is LockResponse's, for the holder's own /status.
	GuaranteedMs Guarantee `json:"guaranteed_ms,omitzero"`
}

// RefRequest is the body of POST /refcount/add and /refcount/release.
type RefRequest struct {
	ResourceID string `json:"resource_id,omitempty"`
	NodeID     string `json:"node_id"`
}

// RefCountResponse is a resource's references.
type RefCountResponse struct {
	ResourceID string   `json:"resource_id"`
	Count      int      `json:"count"`
	Nodes      []string `json:"nodes"`
}

// ReleaseNodeResponse answers a release of every reference of a node.
type ReleaseNodeResponse struct {
	NodeID   string `json:"node_id"`
	Released int    `json:"released"`
}

// Event is the data of an SSE event, as a client decodes it.
type Event struct {
	Event       string    `json:"event"`
	Type        string    `json:"type,omitempty"`
	ResourceID  string    `json:"resource_id,omitempty"`
	NodeID      string    `json:"node_id"`
	Epoch       string    `json:"epoch,omitempty"`
	Token       uint64    `json:"token,omitempty"`
	Success     bool      `json:"success,omitempty"`
	Error       string    `json:"error,omitempty"`
	CompletedAt time.Time `json:"completed_at,omitzero"`
	NextHolder  string    `json:"next_holder,omitempty"`
}

// Guarantee is guaranteed_ms (docs/API.md): milliseconds that an answer
// carries or, from a server that predates it, does not (Set false). A value,
// not a pointer, so that the answer to a /lock allocates nothing for it.
type Guarantee struct {
	Ms  int64
	Set bool
}

// Millis is d as a Guarantee, in whole milliseconds rounded down: a
// guarantee never grows on the wire.
func Millis(d time.Duration) Guarantee { return Guarantee{Ms: int64(d / time.Millisecond), Set: true} }

// IsZero reports an absent guarantee, which omitzero leaves out.
func (g Guarantee) IsZero() bool { return !g.Set }

// MarshalJSON writes the number of milliseconds.
func (g Guarantee) MarshalJSON() ([]byte, error) { return strconv.AppendInt(nil, g.Ms, 10), nil }

// UnmarshalJSON reads a number of milliseconds; null is absent.
func (g *Guarantee) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*g = Guarantee{}
		return nil
	}
	var ms int64
	if err := json.Unmarshal(b, &ms); err != nil {
		return err
	}
	*g = Guarantee{Ms: ms, Set: true}
	return nil
}

// Status converts a lock.Status to its wire form; node is the asking
// node's id ("" when none was given).
func Status(st lock.Status, node string) StatusResponse {
	r := StatusResponse{
		Type:        st.Key.Type.String(),
		ResourceID:  st.Key.Resource,
		State:       "free",
		Token:       st.Token,
		QueueLength: st.QueueLength,
		Position:    st.Position,
	}
	if st.Held {
		r.State, r.Holder, r.AcquiredAt = "held", st.Holder, st.AcquiredAt.UTC().Format(time.RFC3339Nano)
		if node != "" && node == st.Holder {
			r.GuaranteedMs = Millis(st.Guaranteed)
		}
	}
	if c := st.LastCompleted; c != nil {
		r.LastCompleted = &Completion{NodeID: c.Node, Token: c.Token, Success: c.Success, Error: c.Error, CompletedAt: c.CompletedAt.UTC()}
	}
	return r
}

// decode reads one JSON object into v. Unknown fields are ignored: the
// seeds' clients send fields of their own.
func decode(data []byte, v any) error {
	if len(bytes.TrimSpace(data)) == 0 {
		return fmt.Errorf("%w: request body is empty", lock.ErrInvalid)
	}
	if err := json.Unmarshal(data, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return fmt.Errorf("%w: field %s must be a JSON %s", lock.ErrInvalid, te.Field, te.Type)
		}
		return fmt.Errorf("%w: malformed JSON: %s", lock.ErrInvalid, sanitize(err.Error()))
	}
	return nil
}

// sanitize keeps a JSON error's text from reading like a network error to
// the seeds' client, which retries any message that mentions "EOF".
func sanitize(s string) string {
	return strings.ReplaceAll(s, "unexpected end of JSON input", "the JSON ends early")
}

// ParseLock decodes and validates a /lock body.
func ParseLock(data []byte) (lock.LockRequest, error) {
	// Fields of other requests are ignored, as encoding/json ignores them.
	f, ok := parseFast(data)
	if !ok {
		var err error
		if f, err = decodeLock(data); err != nil {
			return lock.LockRequest{}, err
		}
	}
	t, err := lock.ParseType(f.typ)
	if err != nil {
		return lock.LockRequest{}, err
	}
	lease, err := lock.ParseLease(f.lease)
	if err != nil {
		return lock.LockRequest{}, err
	}
	r := lock.LockRequest{Type: t, Resource: f.resource, Node: f.node, Lease: lease, SkipRecent: f.skipRecent}
	return r, r.Validate()
}

// decodeLock reads with encoding/json a /lock body the fast scanner does
// not take. It is a function of its own so that the request it decodes
// into, which escapes through json.Unmarshal, is allocated only here and
// not on the fast path.
func decodeLock(data []byte) (fastFields, error) {
	var w LockRequest
	if err := decode(data, &w); err != nil {
		return fastFields{}, err
	}
	return fastFields{typ: w.Type, resource: w.ResourceID, node: w.NodeID, lease: w.Lease, skipRecent: w.SkipRecent}, nil
}

// ParseUnlock decodes and validates an /unlock body.
func ParseUnlock(data []byte) (lock.UnlockRequest, error) {
	f, ok := parseFast(data)
	if !ok {
		var err error
		if f, err = decodeUnlock(data); err != nil {
			return lock.UnlockRequest{}, err
		}
	}
	t, err := lock.ParseType(f.typ)
	if err != nil {
		return lock.UnlockRequest{}, err
	}
	success := f.errMsg == ""
	if f.hasSuccess {
		success = f.success
	}
	r := lock.UnlockRequest{Type: t, Resource: f.resource, Node: f.node, Success: success, Error: f.errMsg, Token: f.token}
	return r, r.Validate()
}

// decodeUnlock is decodeLock for an /unlock body.
func decodeUnlock(data []byte) (fastFields, error) {
	var w UnlockRequest
	if err := decode(data, &w); err != nil {
		return fastFields{}, err
	}
	f := fastFields{typ: w.Type, resource: w.ResourceID, node: w.NodeID, errMsg: w.Error, token: w.Token}
	if w.Success != nil {
		f.success, f.hasSuccess = *w.Success, true
	}
	return f, nil
}

// ParseKey decodes and validates a /cancel body.
func ParseKey(data []byte) (lock.Key, string, error) {
	var w KeyRequest
	if err := decode(data, &w); err != nil {
		return lock.Key{}, "", err
	}
	t, err := lock.ParseType(w.Type)
	if err != nil {
		return lock.Key{}, "", err
	}
	if err := lock.ValidateResource(w.ResourceID); err != nil {
		return lock.Key{}, "", err
	}
	return lock.Key{Type: t, Resource: w.ResourceID}, w.NodeID, lock.ValidateNode(w.NodeID)
}

// ParseRef decodes and validates a /refcount/add or /refcount/release body.
// With allowNoResource, an absent resource_id is accepted (release-all).
func ParseRef(data []byte, allowNoResource bool) (RefRequest, error) {
	var w RefRequest
	if err := decode(data, &w); err != nil {
		return w, err
	}
	if err := lock.ValidateNode(w.NodeID); err != nil {
		return w, err
	}
	if w.ResourceID == "" && allowNoResource {
		return w, nil
	}
	return w, lock.ValidateResource(w.ResourceID)
}

// AppendLockResponse appends the JSON of r; the hot path avoids reflection.
func AppendLockResponse(b []byte, r LockResponse) []byte {
	b = append(b, `{"acquired":`...)
	b = strconv.AppendBool(b, r.Acquired)
	b = append(b, `,"queued":`...)
	b = strconv.AppendBool(b, r.Queued)
	b = append(b, `,"skip":`...)
	b = strconv.AppendBool(b, r.Skip)
	b = append(b, `,"token":`...)
	b = strconv.AppendUint(b, r.Token, 10)
	b = append(b, `,"holder":`...)
	b = appendString(b, r.Holder)
	b = append(b, `,"position":`...)
	b = strconv.AppendInt(b, int64(r.Position), 10)
	if r.GuaranteedMs.Set {
		b = append(b, `,"guaranteed_ms":`...)
		b = strconv.AppendInt(b, r.GuaranteedMs.Ms, 10)
	}
	return append(b, '}')
}

// AppendUnlockResponse appends the JSON of r.
func AppendUnlockResponse(b []byte, r UnlockResponse) []byte {
	b = append(b, `{"released":`...)
	b = strconv.AppendBool(b, r.Released)
	b = append(b, `,"next_holder":`...)
	b = appendString(b, r.NextHolder)
	if r.Replayed {
		b = append(b, `,"replayed":true`...)
	}
	return append(b, '}')
}

// AppendEventData appends the JSON data of ev (docs/API.md).
func AppendEventData(b []byte, ev *lock.Event) []byte {
	b = append(b, `{"event":`...)
	b = strconv.AppendQuote(b, ev.Name)
	b = append(b, `,"type":"`...)
	b = append(b, ev.Key.Type.String()...)
	b = append(b, `","resource_id":`...)
	b = appendString(b, ev.Key.Resource)
	b = append(b, `,"node_id":`...)
	b = appendString(b, ev.Node)
	if ev.Name == lock.EventLockAssigned {
		b = append(b, `,"token":`...)
		b = strconv.AppendUint(b, ev.Token, 10)
		return append(b, '}')
	}
	b = append(b, `,"success":`...)
	b = strconv.AppendBool(b, ev.Success)
	b = append(b, `,"error":`...)
	b = appendString(b, ev.Error)
	b = append(b, `,"completed_at":"`...)
	b = ev.CompletedAt.UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","next_holder":`...)
	b = appendString(b, ev.NextHolder)
	return append(b, '}')
}

// AppendSubscribed appends the data of the subscribed event: exactly
// node_id and epoch besides the name, never type or resource_id.
func AppendSubscribed(b []byte, node, epoch string) []byte {
	b = append(b, `{"event":"subscribed","node_id":`...)
	b = appendString(b, node)
	b = append(b, `,"epoch":`...)
	b = appendString(b, epoch)
	return append(b, '}')
}

// appendString appends s as a JSON string. Identifiers have no control
// characters, but error texts might.
func appendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == '"' || c == '\\' || c >= 0x80 {
			enc, _ := json.Marshal(s)
			return append(b, enc...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// ErrorBody is every error body: error and message carry the same text (the
// seeds' client reads message).
type ErrorBody struct {
	Error   string `json:"error"`
	Code    string `json:"code"`
	Message string `json:"message"`
	Holder  string `json:"holder,omitempty"`
}

// Error codes.
const (
	CodeInvalid          = "invalid_request"
	CodeTooLarge         = "too_large"
	CodeMethodNotAllowed = "method_not_allowed"
	CodeNotFound         = "not_found"
	CodeLockHeld         = "lock_held"
	CodeNotHolder        = "not_holder"
	CodeStaleToken       = "stale_token"
	CodeInUse            = "in_use"
	CodeDeleting         = "deleting"
	CodeUpdating         = "updating"
	CodeUnavailable      = "unavailable"
	CodeInternal         = "internal"
	CodeOverloaded       = "overloaded"
	CodeTooManySessions  = "too_many_sessions"
	CodeQueueFull        = "queue_full"
	CodeTooManyKeys      = "too_many_keys"
	CodeTooManyWatchers  = "too_many_watchers"
	CodeTooManyTypes     = "too_many_types"
	CodeUnauthorized     = "unauthorized"
	CodeForbidden        = "forbidden"
)

// ErrNotFound is an unknown path, or a refcount endpoint with refcount off.
var ErrNotFound = errors.New("not found")

// ErrTooLarge is a request body over MaxBody.
var ErrTooLarge = errors.New("request body is larger than 64 KiB")

// ErrMethodNotAllowed is a known path with the wrong method.
var ErrMethodNotAllowed = errors.New("method not allowed")

// ErrUnavailable is a server that is shutting down.
var ErrUnavailable = errors.New("server is shutting down")

// ErrOverloaded is a server at its connection limit.
var ErrOverloaded = errors.New("server has too many open connections")

// ErrUnauthorized is a request without a valid credential where the server
// checks identities: no or an unknown bearer token, no client certificate
// (docs/SECURITY.md).
var ErrUnauthorized = errors.New("unauthorized")

// ErrForbidden is a request whose credential may not do what it asks: act
// as another node, or use an operator's endpoint (docs/SECURITY.md).
var ErrForbidden = errors.New("forbidden")

// codes maps errors to their code and status. retryAfter, in seconds, is
// sent as the Retry-After header: the refusal is one of load, and the same
// request may succeed later.
var codes = []struct {
	err        error
	code       string
	status     int
	retryAfter int
}{
	{lock.ErrInvalid, CodeInvalid, http.StatusBadRequest, 0},
	{ErrTooLarge, CodeTooLarge, http.StatusRequestEntityTooLarge, 0},
	{ErrMethodNotAllowed, CodeMethodNotAllowed, http.StatusMethodNotAllowed, 0},
	{ErrNotFound, CodeNotFound, http.StatusNotFound, 0},
	{lock.ErrRefCountOff, CodeNotFound, http.StatusNotFound, 0},
	{lock.ErrLockHeld, CodeLockHeld, http.StatusConflict, 0},
	{lock.ErrNotHolder, CodeNotHolder, http.StatusForbidden, 0},
	{lock.ErrStaleToken, CodeStaleToken, http.StatusConflict, 0},
	{lock.ErrInUse, CodeInUse, http.StatusConflict, 0},
	{lock.ErrDeleting, CodeDeleting, http.StatusConflict, 0},
	{lock.ErrUpdating, CodeUpdating, http.StatusConflict, 0},
	{lock.ErrClosed, CodeUnavailable, http.StatusServiceUnavailable, 1},
	{lock.ErrUnavailable, CodeUnavailable, http.StatusServiceUnavailable, 1},
	{ErrUnavailable, CodeUnavailable, http.StatusServiceUnavailable, 1},
	{ErrOverloaded, CodeOverloaded, http.StatusServiceUnavailable, 1},
	{lock.ErrTooManySessions, CodeTooManySessions, http.StatusTooManyRequests, 1},
	{lock.ErrQueueFull, CodeQueueFull, http.StatusTooManyRequests, 1},
	{lock.ErrTooManyKeys, CodeTooManyKeys, http.StatusServiceUnavailable, 1},
	{lock.ErrTooManyWatchers, CodeTooManyWatchers, http.StatusTooManyRequests, 1},
	// A 400, not a 429 or 503: a type name the process has no room for
	// stays refused until it restarts, so trying again later cannot help
	// (docs/DESIGN.md, "Other types").
	{lock.ErrTooManyTypes, CodeTooManyTypes, http.StatusBadRequest, 0},
	{ErrUnauthorized, CodeUnauthorized, http.StatusUnauthorized, 0},
	{ErrForbidden, CodeForbidden, http.StatusForbidden, 0},
}

// RetryAfter is the Retry-After header value, in seconds, that answers err;
// 0 means the header is not sent.
func RetryAfter(err error) int {
	for _, c := range codes {
		if errors.Is(err, c.err) {
			return c.retryAfter
		}
	}
	return 0
}

// RetryAfterStatus is the Retry-After, in seconds, of an error answer with
// status, for writers that keep only the status: every 429 and 503 carries
// the header (docs/API.md), with the longest value of the errors answered
// with that status. 0 for any other status.
func RetryAfterStatus(status int) int {
	if status != http.StatusTooManyRequests && status != http.StatusServiceUnavailable {
		return 0
	}
	n := 0
	for _, c := range codes {
		if c.status == status {
			n = max(n, c.retryAfter)
		}
	}
	return n
}

// ErrorResponse maps err to its status code and body.
func ErrorResponse(err error) (int, ErrorBody) {
	body := ErrorBody{Error: err.Error(), Message: err.Error(), Code: CodeInternal}
	if he, ok := errors.AsType[*lock.HeldError](err); ok {
		body.Holder = he.Holder
	}
	for _, c := range codes {
		if errors.Is(err, c.err) {
			body.Code = c.code
			return c.status, body
		}
	}
	return http.StatusInternalServerError, body
}

// ErrorFromResponse turns an error body back into an error that matches the sentinel
// of its code with errors.Is and carries the server's message.
func ErrorFromResponse(status int, body ErrorBody) error {
	msg := body.Message
	if msg == "" {
		msg = body.Error
	}
	if body.Code == CodeLockHeld && body.Holder != "" {
		return &Error{Status: status, Code: body.Code, Message: msg, Holder: body.Holder, err: &lock.HeldError{Holder: body.Holder}}
	}
	for _, c := range codes {
		if c.code == body.Code {
			return &Error{Status: status, Code: body.Code, Message: msg, err: c.err}
		}
	}
	return &Error{Status: status, Code: body.Code, Message: msg}
}

// Error is an error answered by a dlock server. errors.As gives its HTTP
// status and code; errors.Is matches the sentinel of its code (lock.ErrLockHeld,
// lock.ErrQueueFull, ...), and errors.As a *lock.HeldError when the server
// named the holder.
type Error struct {
	Status  int
	Code    string
	Message string
	// Holder is the node holding the lock, for code lock_held.
	Holder string
	err    error
}

func (e *Error) Error() string {
	return fmt.Sprintf("dlock: %s (%d %s)", e.Message, e.Status, e.Code)
}

// Unwrap returns the sentinel of the error's code.
func (e *Error) Unwrap() error { return e.err }

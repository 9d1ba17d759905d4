package lock

import (
	"cmp"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Type is the kind of operation a lock is taken for. Different types of one
// resource have separate holders and queues.
//
// Pull, Update and Delete are built in. Any other name of the form
// [a-z][a-z0-9-]{0,31} is a type too, with pull's rules and no reference
// rules (docs/DESIGN.md, "Other types"): ParseType gives it a number of its
// own, the same for the life of the process, so that a Type stays one byte
// that engines keep in their keys and compare with ==. Its name, not its
// number, is what crosses the wire or goes into storage: another process
// numbers the same name differently.
type Type uint8

// The built-in operation types. The zero Type is invalid.
const (
	Pull Type = iota + 1
	Update
	Delete
)

func (t Type) String() string {
	if name, ok := typeName(t); ok {
		return name
	}
	return fmt.Sprintf("Type(%d)", uint8(t))
}

// Valid reports whether t is Pull, Update, Delete or a type ParseType or
// InternType made.
func (t Type) Valid() bool {
	_, ok := typeName(t)
	return ok
}

// Builtin reports whether t is Pull, Update or Delete, the types with
// reference rules (docs/DESIGN.md, "Reference rules").
func (t Type) Builtin() bool { return t >= Pull && t <= Delete }

// ParseType parses the wire name of an operation type: pull, update,
// delete, or another name of the form [a-z][a-z0-9-]{0,31}. A name the
// process has not seen yet is given a Type of its own, for good; at most
// MaxExtraTypes such names are taken from callers, and the next one fails
// with ErrTooManyTypes (docs/DESIGN.md, "Other types").
func ParseType(s string) (Type, error) {
	if t, ok := LookupType(s); ok {
		return t, nil
	}
	if err := validTypeName(s); err != nil {
		return 0, err
	}
	return internType(s, true)
}

// LookupType returns the Type of a name the process knows already; it never
// makes a new one.
func LookupType(s string) (Type, bool) {
	switch s {
	case "pull":
		return Pull, true
	case "update":
		return Update, true
	case "delete":
		return Delete, true
	}
	t, ok := types.Load().byName[s]
	return t, ok
}

// InternType is ParseType for a name a backend reads back from its own
// storage, where a server of its data set put it after ParseType took it
// from a caller: it does not count against MaxExtraTypes, so that every
// server can name every key of the data set. It fails only for a name of
// the wrong form, or when the process knows MaxTypes names already.
func InternType(s string) (Type, error) {
	if t, ok := LookupType(s); ok {
		return t, nil
	}
	if err := validTypeName(s); err != nil {
		return 0, err
	}
	return internType(s, false)
}

// CompareTypes orders types the same way in every process: the built-in
// types in their order, then the others by name.
func CompareTypes(a, b Type) int {
	switch ab, bb := a <= Delete, b <= Delete; {
	case ab && bb:
		return cmp.Compare(a, b)
	case ab:
		return -1
	case bb:
		return 1
	}
	return strings.Compare(a.String(), b.String())
}

// Lease says what keeps a hold or a queue entry alive.
type Lease uint8

const (
	// LeaseAuto resolves to LeaseSession when the node has a session, else LeaseTTL.
	LeaseAuto Lease = iota
	// LeaseSession lives as long as the node's event-stream session.
	LeaseSession
	// LeaseTTL lives Config.LockTTL after the grant or the node's last renewal.
	LeaseTTL
)

func (l Lease) String() string {
	switch l {
	case LeaseSession:
		return "session"
	case LeaseTTL:
		return "ttl"
	}
	return "auto"
}

// ParseLease parses "session", "ttl" or "" (auto).
func ParseLease(s string) (Lease, error) {
	switch s {
	case "":
		return LeaseAuto, nil
	case "session":
		return LeaseSession, nil
	case "ttl":
		return LeaseTTL, nil
	}
	return 0, fmt.Errorf("%w: lease must be session or ttl, not %q", ErrInvalid, s)
}

// Key identifies one lock: an operation type on a resource.
type Key struct {
	Type     Type
	Resource string
}

func (k Key) String() string { return k.Type.String() + ":" + k.Resource }

// Limits on identifiers and texts (docs/API.md).
const (
	MaxResourceLen = 512
	MaxNodeLen     = 256
	// MaxErrorLen bounds the error text of a completion kept in records
	// and events; a longer one is cut and ends with "…".
	MaxErrorLen = 1024
)

// ValidateResource checks a resource id: 1–512 bytes, see validateID.
func ValidateResource(s string) error { return validateID("resource_id", s, MaxResourceLen) }

// ValidateNode checks a node id: 1–256 bytes, see validateID.
func ValidateNode(s string) error { return validateID("node_id", s, MaxNodeLen) }

// validateID accepts valid UTF-8 without control characters, without
// U+FFFD and without bidirectional controls (docs/SECURITY.md):
//   - encoding/json turns invalid UTF-8 and lone surrogate escapes into
//     U+FFFD, so "a\ud800" and "a\udfff" would both arrive as "a\uFFFD" and
//     name one node; refusing U+FFFD keeps two different byte strings from
//     ever naming one node or resource;
//   - bidirectional controls (the Unicode property Bidi_Control: the
//     embeddings, overrides and isolates U+202A–U+202E and U+2066–U+2069,
//     and the marks U+061C, U+200E and U+200F) make an id display as
//     another one in logs and terminals, and no id needs them.
//
// Printable ASCII, every id in practice, takes the fast path.
func validateID(field, s string, max int) error {
	if s == "" {
		return fmt.Errorf("%w: %s is required", ErrInvalid, field)
	}
	if len(s) > max {
		return fmt.Errorf("%w: %s is %d bytes, at most %d are allowed", ErrInvalid, field, len(s), max)
	}
	ascii := true
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f {
			ascii = false
			break
		}
	}
	if ascii {
		return nil
	}
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalid, field)
		case r == utf8.RuneError:
			return fmt.Errorf("%w: %s contains U+FFFD at byte %d (invalid UTF-8 or a lone surrogate escape)", ErrInvalid, field, i)
		case unicode.IsControl(r):
			return fmt.Errorf("%w: %s contains a control character at byte %d", ErrInvalid, field, i)
		case unicode.Is(unicode.Bidi_Control, r):
			return fmt.Errorf("%w: %s contains the bidirectional control %U at byte %d", ErrInvalid, field, r, i)
		}
		i += size
	}
	return nil
}

// TruncateError bounds an error text to MaxErrorLen bytes of valid UTF-8:
// a longer one is cut on a character boundary and ends with "…".
func TruncateError(s string) (string, bool) {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if len(s) <= MaxErrorLen {
		return s, false
	}
	const mark = "…"
	cut := MaxErrorLen - len(mark)
	for !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark, true
}

// ValidateKey checks a key and a node id as every request does.
func ValidateKey(t Type, resource, node string) error {
	if !t.Valid() {
		if t == 0 {
			return fmt.Errorf("%w: type is required", ErrInvalid)
		}
		return fmt.Errorf("%w: %v is not a type of this process", ErrInvalid, t)
	}
	if err := ValidateResource(resource); err != nil {
		return err
	}
	return ValidateNode(node)
}

// LockRequest asks for a lock (docs/API.md, "POST /lock").
type LockRequest struct {
	Type     Type
	Resource string
	Node     string
	Lease    Lease
	// SkipRecent answers Skip instead of granting when the key is free and its
	// last retained completion was a success (pull and delete only).
	SkipRecent bool
}

// Key returns the lock key the request is for.
func (r LockRequest) Key() Key { return Key{r.Type, r.Resource} }

// Validate reports a wrapped ErrInvalid naming the first bad field.
func (r LockRequest) Validate() error {
	if err := ValidateKey(r.Type, r.Resource, r.Node); err != nil {
		return err
	}
	if r.Lease > LeaseTTL {
		return fmt.Errorf("%w: unknown lease %d", ErrInvalid, r.Lease)
	}
	return nil
}

// LockResult is the answer to a LockRequest. Exactly one of Acquired, Queued
// and Skip is true.
type LockResult struct {
	Acquired bool
	Queued   bool
	Skip     bool
	Token    uint64 // the grant's fencing token when Acquired
	Holder   string // the current holder ("" when Skip)
	Position int    // 1-based queue position when Queued
	// Guaranteed, when Acquired, is how long from the moment the backend
	// handled the call the hold is sure to stand: nothing can end it and
	// hand the key on before (docs/DESIGN.md, "Leases"). 0 when the
	// backend cannot vouch for it. A client's lease runs from when it sent
	// the call.
	Guaranteed time.Duration
}

// UnlockRequest ends a hold (docs/API.md, "POST /unlock").
type UnlockRequest struct {
	Type     Type
	Resource string
	Node     string
	Success  bool
	Error    string
	// Token, when not zero, must match the current grant's token.
	Token uint64
}

// Key returns the lock key the request is for.
func (r UnlockRequest) Key() Key { return Key{r.Type, r.Resource} }

// Validate reports a wrapped ErrInvalid naming the first bad field.
func (r UnlockRequest) Validate() error { return ValidateKey(r.Type, r.Resource, r.Node) }

// UnlockResult is the answer to an UnlockRequest.
type UnlockResult struct {
	NextHolder string // the node the lock was handed to, "" when it became free
	Replayed   bool   // a repeated unlock whose first answer was lost
}

// CancelResult is the answer to Cancel.
type CancelResult struct {
	Dequeued bool // the node was waiting and left the queue
	Released bool // the node held the lock and gave it up as a failure
}

// Completion is the retained record of a finished hold.
type Completion struct {
	Node        string
	Token       uint64
	Success     bool
	Error       string
	CompletedAt time.Time
}

// Status describes one key.
type Status struct {
	Key           Key
	Held          bool
	Holder        string
	Token         uint64 // the holder's token, or the last token issued when free
	AcquiredAt    time.Time
	QueueLength   int
	Position      int // the asking node's 1-based queue position, 0 if not queued
	LastCompleted *Completion
	// Guaranteed is LockResult.Guaranteed for the asking node's hold, when
	// the call named the holder; else 0.
	Guaranteed time.Duration
}

// Errors returned by the manager. Use errors.Is; messages never contain the
// words a retrying client takes for network trouble.
var (
	ErrInvalid     = errors.New("invalid request")
	ErrLockHeld    = errors.New("lock is held by another node")
	ErrNotHolder   = errors.New("not the holder of this lock")
	ErrStaleToken  = errors.New("token does not match the current grant")
	ErrInUse       = errors.New("resource is in use")
	ErrDeleting    = errors.New("resource is being deleted")
	ErrUpdating    = errors.New("resource is being updated")
	ErrRefCountOff = errors.New("reference counting is off")
	ErrClosed      = errors.New("lock manager is closed")
	// ErrUnavailable is a backend that cannot reach its state (an etcd
	// cluster without quorum, or out of reach): try again, maybe on
	// another server.
	ErrUnavailable = errors.New("lock state is unavailable")

	// Limits (docs/SECURITY.md): the caller may try again later.
	ErrTooManySessions = errors.New("too many sessions")
	ErrQueueFull       = errors.New("the queue of this key is full")
	ErrTooManyKeys     = errors.New("too many keys with state")
	ErrTooManyWatchers = errors.New("too many observer and operator streams")

	// ErrTooManyTypes is a type name beyond the MaxExtraTypes that one
	// process takes: unlike the limits above it does not pass with time,
	// since a name, once taken, is kept for the life of the process.
	ErrTooManyTypes = errors.New("too many type names")
)

// HeldError is returned when multi-node download mode is off and another node
// holds the key, or the key is reserved by Rules.LockDelay (Holder is then
// ""). It matches ErrLockHeld.
type HeldError struct{ Holder string }

func (e *HeldError) Error() string {
	if e.Holder == "" {
		return "lock is reserved until its lock delay has passed"
	}
	return "lock is held by " + e.Holder
}

// Unwrap makes errors.Is(err, ErrLockHeld) true.
func (e *HeldError) Unwrap() error { return ErrLockHeld }

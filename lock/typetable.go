package lock

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// Limits of the type names besides pull, update and delete (docs/DESIGN.md,
// "Other types").
const (
	// MaxTypeLen is the longest type name.
	MaxTypeLen = 32
	// MaxExtraTypes is how many names besides pull, update and delete
	// ParseType takes from callers in one process. Names are never
	// forgotten (a Type must keep naming its key while any state has it),
	// so the bound is what keeps callers from filling the process with
	// names; real deployments use one or two.
	MaxExtraTypes = 64
	// MaxTypes is how many types a process can tell apart in all: a Type
	// is one byte. InternType, for names read back from storage, may go
	// past MaxExtraTypes up to it.
	MaxTypes = 255
)

// typeTable is the process's type names, by Type. A table is never changed
// once published: internType publishes a copy with the new name, so that a
// lookup is one atomic load and a map read, without a lock.
type typeTable struct {
	names    []string        // by Type; names[0] is "", the invalid Type
	byName   map[string]Type // every name but the built-in ones
	admitted int             // the names ParseType took from callers
}

var (
	typesMu sync.Mutex // serializes internType
	types   atomic.Pointer[typeTable]
	// typesRefused counts the names ParseType refused for maxExtraTypes.
	typesRefused atomic.Uint64
	// maxExtraTypes is MaxExtraTypes, lowered by tests.
	maxExtraTypes = MaxExtraTypes
)

func init() { types.Store(builtinTypes()) }

// RefusedTypes is how many times ParseType refused a name because the
// process had taken MaxExtraTypes already (ErrTooManyTypes).
func RefusedTypes() uint64 { return typesRefused.Load() }

func builtinTypes() *typeTable {
	return &typeTable{names: []string{"", "pull", "update", "delete"}, byName: map[string]Type{}}
}

func typeName(t Type) (string, bool) {
	names := types.Load().names
	if t == 0 || int(t) >= len(names) {
		return "", false
	}
	return names[t], true
}

// validTypeName checks the form of a name that is not a built-in type:
// [a-z][a-z0-9-]{0,31}, safe in an etcd key, a URL and a CSS class alike.
func validTypeName(s string) error {
	bad := func(why string) error {
		return fmt.Errorf("%w: type %.40q %s: a type is pull, update, delete, or a name of lowercase letters, digits and '-', starting with a letter, at most %d bytes",
			ErrInvalid, s, why, MaxTypeLen)
	}
	switch {
	case s == "":
		return fmt.Errorf("%w: type is required", ErrInvalid)
	case len(s) > MaxTypeLen:
		return bad(fmt.Sprintf("is %d bytes", len(s)))
	case s[0] < 'a' || s[0] > 'z':
		return bad("does not start with a lowercase letter")
	}
	for i := 1; i < len(s); i++ {
		if c := s[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return bad(fmt.Sprintf("has %q at byte %d", c, i))
		}
	}
	return nil
}

// internType gives the valid name s a Type: the one it has, or a new one.
// A name a caller brings (admit) counts against maxExtraTypes.
func internType(s string, admit bool) (Type, error) {
	typesMu.Lock()
	defer typesMu.Unlock()
	old := types.Load()
	if t, ok := old.byName[s]; ok {
		return t, nil
	}
	if admit && old.admitted >= maxExtraTypes {
		typesRefused.Add(1)
		return 0, fmt.Errorf("%w: type %q: a dlock process takes %d type names besides pull, update and delete, and this one has them all (kept until it restarts): use one it knows",
			ErrTooManyTypes, s, maxExtraTypes)
	}
	if len(old.names) > MaxTypes {
		return 0, fmt.Errorf("%w: type %q: this process knows %d types, the most it can tell apart", ErrTooManyTypes, s, MaxTypes)
	}
	t := Type(len(old.names))
	nt := &typeTable{
		names:    append(slices.Clip(old.names), strings.Clone(s)),
		byName:   maps.Clone(old.byName),
		admitted: old.admitted,
	}
	nt.byName[nt.names[t]] = t
	if admit {
		nt.admitted++
	}
	types.Store(nt)
	return t, nil
}

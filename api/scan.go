package api

import "strconv"

// fastFields parses the flat JSON objects of /lock and /unlock (docs/DESIGN.md,
// "The fast path and its guarantees")
// without reflection: string values without escapes, booleans, unsigned
// integers. It reports ok=false for anything else (escapes, nesting, other
// value types, duplicate keys, malformed input), and the caller then takes
// encoding/json's path, which also words the errors. A differential fuzz
// test holds it to encoding/json's results.
type fastFields struct {
	typ, resource, node, lease, errMsg string
	skipRecent, success                bool
	hasSuccess                         bool
	token                              uint64
}

func parseFast(data []byte) (f fastFields, ok bool) {
	i := skipWS(data, 0)
	if i >= len(data) || data[i] != '{' {
		return f, false
	}
	i = skipWS(data, i+1)
	if i < len(data) && data[i] == '}' {
		return f, skipWS(data, i+1) == len(data)
	}
	var seen uint16
	for {
		key, j, ok := fastRaw(data, i)
		if !ok {
			return f, false
		}
		i = skipWS(data, j)
		if i >= len(data) || data[i] != ':' {
			return f, false
		}
		i = skipWS(data, i+1)
		if i >= len(data) {
			return f, false
		}
		var bit uint16
		switch string(key) { // no allocation: the compiler compares the bytes
		case "type":
			bit = 1 << 0
			f.typ, i, ok = fastName(data, i, "pull", "update", "delete")
		case "resource_id":
			bit = 1 << 1
			f.resource, i, ok = fastString(data, i)
		case "node_id":
			bit = 1 << 2
			f.node, i, ok = fastString(data, i)
		case "lease":
			bit = 1 << 3
			f.lease, i, ok = fastName(data, i, "session", "ttl")
		case "error":
			bit = 1 << 4
			f.errMsg, i, ok = fastString(data, i)
		case "skip_recent":
			bit = 1 << 5
			f.skipRecent, i, ok = fastBool(data, i)
		case "success":
			bit = 1 << 6
			f.success, i, ok = fastBool(data, i)
			f.hasSuccess = true
		case "token":
			bit = 1 << 7
			f.token, i, ok = fastUint(data, i)
		default:
			return f, false // unknown fields are ignored, by the slow path
		}
		if !ok || seen&bit != 0 {
			return f, false
		}
		seen |= bit
		i = skipWS(data, i)
		if i >= len(data) {
			return f, false
		}
		switch data[i] {
		case ',':
			i = skipWS(data, i+1)
		case '}':
			return f, skipWS(data, i+1) == len(data)
		default:
			return f, false
		}
	}
}

func skipWS(data []byte, i int) int {
	for i < len(data) && (data[i] == ' ' || data[i] == '\t' || data[i] == '\n' || data[i] == '\r') {
		i++
	}
	return i
}

// fastRaw reads a JSON string of printable ASCII without escapes.
func fastRaw(data []byte, i int) ([]byte, int, bool) {
	if i >= len(data) || data[i] != '"' {
		return nil, i, false
	}
	for j := i + 1; j < len(data); j++ {
		switch c := data[j]; {
		case c == '"':
			return data[i+1 : j], j + 1, true
		case c == '\\' || c < 0x20 || c >= 0x7f:
			return nil, i, false
		}
	}
	return nil, i, false
}

func fastString(data []byte, i int) (string, int, bool) {
	b, j, ok := fastRaw(data, i)
	return string(b), j, ok
}

// fastName is fastString for a field with a few known values: a known
// one is returned as the constant, without allocating a string for it.
func fastName(data []byte, i int, names ...string) (string, int, bool) {
	b, j, ok := fastRaw(data, i)
	for _, n := range names {
		if string(b) == n {
			return n, j, ok
		}
	}
	return string(b), j, ok
}

func fastBool(data []byte, i int) (bool, int, bool) {
	switch {
	case len(data)-i >= 4 && string(data[i:i+4]) == "true":
		return true, i + 4, true
	case len(data)-i >= 5 && string(data[i:i+5]) == "false":
		return false, i + 5, true
	}
	return false, i, false
}

// fastUint reads a plain unsigned integer (no sign, fraction or exponent).
func fastUint(data []byte, i int) (uint64, int, bool) {
	j := i
	for j < len(data) && data[j] >= '0' && data[j] <= '9' {
		j++
	}
	if j == i || (data[i] == '0' && j-i > 1) {
		return 0, i, false
	}
	if j < len(data) && (data[j] == '.' || data[j] == 'e' || data[j] == 'E') {
		return 0, i, false
	}
	v, err := strconv.ParseUint(string(data[i:j]), 10, 64)
	if err != nil {
		return 0, i, false
	}
	return v, j, true
}

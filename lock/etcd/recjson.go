package etcd

import (
	"math"
	"strconv"
)

// Every server's watch reads every key record written, and encoding/json
// spends some 6 µs on one (its reflection, per field): on a busy key, a
// tenth of the server's CPU. fastKey reads the JSON that encode makes of a
// keyRec (no whitespace, strings of printable ASCII without escapes,
// integers in their shortest form) and leaves anything else, with every
// error, to encoding/json; FuzzRecordMatchesJSON holds the two equal on
// any bytes.

// fastKey decodes b, a key record as encode makes it; ok false: b is not
// in that form, and encoding/json must read it.
func fastKey(b []byte) (r keyRec, ok bool) {
	s := scan{b: b}
	ok = s.object(func(name []byte) bool {
		switch string(name) {
		case "h":
			r.Holder, ok = s.str()
		case "t":
			r.Token, ok = s.uint(math.MaxUint64)
		case "l":
			var l uint64
			l, ok = s.uint(math.MaxUint8)
			r.Lease = uint8(l)
		case "sl":
			r.SLease, ok = s.int()
		case "at":
			r.Acquired, ok = s.int()
		case "ttl":
			r.TTL, ok = s.int()
		case "cl":
			r.Claim, ok = s.int()
		case "mh":
			r.MaxHold, ok = s.int()
		case "q":
			var q int64
			q, ok = s.int()
			r.Queue = int(q)
		case "s":
			r.Seq, ok = s.uint(math.MaxUint64)
		case "wt":
			r.WaitTTL, ok = s.int()
		case "dl":
			r.Delay, ok = s.int()
		case "c":
			r.Done, ok = s.done()
		case "x":
			r.X, ok = s.trans()
		default:
			return false
		}
		return ok
	})
	return r, ok && s.i == len(b)
}

// A fleet that opens writes a session record per node, and every server's
// watch reads each: encodeSess and fastSess do for sessRec what encode and
// fastKey do for keyRec, without encoding/json's reflection.
// FuzzSessionMatchesJSON holds decodeSess to encoding/json on any bytes,
// and encodeSess to encode on any record.

// encodeSess is encode(sessRec{…}): the same bytes.
func encodeSess(r sessRec) string {
	b := make([]byte, 0, 48)
	b = append(b, `{"l":`...)
	b = strconv.AppendInt(b, r.Lease, 10)
	if r.Home != 0 {
		b = append(b, `,"h":`...)
		b = strconv.AppendInt(b, r.Home, 10)
	}
	return string(append(b, '}'))
}

// decodeSess decodes a session record.
func decodeSess(b []byte) (sessRec, error) {
	if r, ok := fastSess(b); ok {
		return r, nil
	}
	var r sessRec
	if err := jsonUnmarshal(b, &r); err != nil {
		return sessRec{}, err
	}
	return r, nil
}

// fastSess decodes b, a session record as encodeSess makes it; ok false:
// b is not in that form, and encoding/json must read it.
func fastSess(b []byte) (r sessRec, ok bool) {
	s := scan{b: b}
	ok = s.object(func(name []byte) bool {
		switch string(name) {
		case "l":
			r.Lease, ok = s.int()
		case "h":
			r.Home, ok = s.int()
		default:
			return false
		}
		return ok
	})
	return r, ok && s.i == len(b)
}

// scan reads b from i; every method answers false, and reads no further,
// at anything outside the form fastKey reads.
type scan struct {
	b []byte
	i int
}

func (s *scan) byte(c byte) bool {
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// object reads {"name":value,...}, each name once, each value by field.
func (s *scan) object(field func(name []byte) bool) bool {
	if !s.byte('{') {
		return false
	}
	if s.byte('}') {
		return true
	}
	var seen [16][]byte
	for n := 0; ; n++ {
		name, ok := s.raw()
		if !ok || n == len(seen) || !s.byte(':') {
			return false
		}
		for _, o := range seen[:n] {
			if string(o) == string(name) {
				return false // a name twice: encoding/json keeps the last
			}
		}
		seen[n] = name
		if !field(name) {
			return false
		}
		if s.byte('}') {
			return true
		}
		if !s.byte(',') {
			return false
		}
	}
}

// str reads a string of printable ASCII without escapes, the only strings
// whose bytes are their value for encoding/json.
func (s *scan) str() (string, bool) {
	v, ok := s.raw()
	return string(v), ok
}

// raw is str's bytes, in b.
func (s *scan) raw() ([]byte, bool) {
	if !s.byte('"') {
		return nil, false
	}
	start := s.i
	for ; s.i < len(s.b); s.i++ {
		switch c := s.b[s.i]; {
		case c == '"':
			v := s.b[start:s.i]
			s.i++
			return v, true
		case c < 0x20 || c > 0x7e || c == '\\':
			return nil, false
		}
	}
	return nil, false
}

// uint reads an unsigned integer in its shortest form, at most limit.
func (s *scan) uint(limit uint64) (uint64, bool) {
	start := s.i
	var v uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		d := uint64(s.b[s.i] - '0')
		if v > (limit-d)/10 {
			return 0, false
		}
		v = v*10 + d
		s.i++
	}
	n := s.i - start
	if n == 0 || n > 1 && s.b[start] == '0' {
		return 0, false
	}
	if s.i < len(s.b) && (s.b[s.i] == '.' || s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		return 0, false // a fraction or exponent: encoding/json's to refuse
	}
	return v, true
}

// int reads a signed 64-bit integer in its shortest form.
func (s *scan) int() (int64, bool) {
	neg := s.byte('-')
	limit := uint64(math.MaxInt64)
	if neg {
		limit++
	}
	v, ok := s.uint(limit)
	if !ok || neg && v == 0 {
		return 0, false // "-0" is encoding/json's to read
	}
	if neg {
		return -int64(v-1) - 1, true
	}
	return int64(v), true
}

func (s *scan) bool() (bool, bool) {
	for _, w := range [...]string{"true", "false"} {
		if len(s.b)-s.i >= len(w) && string(s.b[s.i:s.i+len(w)]) == w {
			s.i += len(w)
			return w == "true", true
		}
	}
	return false, false
}

func (s *scan) done() (*done, bool) {
	d := &done{}
	ok := s.object(func(name []byte) (ok bool) {
		switch string(name) {
		case "n":
			d.Node, ok = s.str()
		case "t":
			d.Token, ok = s.uint(math.MaxUint64)
		case "ok":
			d.OK, ok = s.bool()
		case "e":
			d.Err, ok = s.str()
		case "at":
			d.At, ok = s.int()
		case "nx":
			d.Next, ok = s.str()
		case "u":
			d.Unlock, ok = s.bool()
		}
		return ok
	})
	return d, ok
}

func (s *scan) trans() (*trans, bool) {
	x := &trans{}
	ok := s.object(func(name []byte) (ok bool) {
		switch string(name) {
		case "a":
			x.Assigned, ok = s.str()
		case "c":
			x.Done, ok = s.done()
		case "k":
			x.Skip, ok = s.bool()
		case "ix":
			x.Left, ok = s.bool()
		case "r":
			x.Refused, ok = s.strs()
		case "at":
			x.At, ok = s.int()
		}
		return ok
	})
	return x, ok
}

// strs reads an array of strings; [] is an empty slice, as for
// encoding/json.
func (s *scan) strs() ([]string, bool) {
	if !s.byte('[') {
		return nil, false
	}
	out := []string{}
	if s.byte(']') {
		return out, true
	}
	for {
		v, ok := s.str()
		if !ok {
			return nil, false
		}
		out = append(out, v)
		if s.byte(']') {
			return out, true
		}
		if !s.byte(',') {
			return nil, false
		}
	}
}

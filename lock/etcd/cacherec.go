package etcd

import (
	"encoding/binary"
	"errors"
	"unicode/utf8"
	"unique"
)

// A key's record as the cache keeps it (docs/DESIGN.md, "An etcd backend",
// "What a server keeps"): the fields of keyRec in binary, each only when
// set, and without X, the transition its write made, which only the
// watch's events read (a call writes its own, tx.put). A session-held
// lock's record is some 40 bytes so, where its JSON is over 100. It begins
// with compactTag, which no JSON value begins with, and decodeKey reads
// either form: a value that does not decode as a record is kept as etcd has
// it, and read as etcd has it.
//
// A record with a holder keeps its holder and session lease apart, once for
// every record that has the same two (cVal.who): a session's locks all
// repeat them, and without them a session-held lock's record is some 14
// bytes, one 16-byte allocation, where it took a 48-byte one.
//
// Every field of keyRec but X is here: a field added to keyRec must be
// added here too (TestCacheRecordCompact fills every field).

const compactTag = 0xc1 // never the first byte of UTF-8 text

// The fields, in the order they follow the mask.
const (
	cHolder = 1 << iota
	cToken
	cLease
	cSLease // the fixed-width ones (fixedFields), from here to cDelay
	cAcquired
	cTTL
	cClaim
	cMaxHold
	cWaitTTL
	cDelay
	cQueue
	cSeq
	cDone
)

// And those of a done.
const (
	dNode = 1 << iota
	dToken
	dOK
	dErr
	dAt
	dNext
	dUnlock
)

var errCompact = errors.New("etcd backend: a cached record cut short")

// holding is a record's holder and session lease, which the cache keeps
// once for all the records that have them (unique.Make): the garbage
// collector lets a pair go with the last record that refers to it.
type holding struct {
	holder string
	slease int64
}

// cVal is a value as the cache keeps it (recCache.cacheForm): a key's
// record compact, its holder and session lease in who when it has a
// holder, or any other value as etcd has it. A string, not a byte slice:
// 8 bytes less in every entry of the cache's map, which has one per key.
type cVal struct {
	b   string
	who unique.Handle[holding] // the zero Handle: b is whole
}

// whole reports whether b is the value whole, without a holding apart.
func (v cVal) whole() bool { return v.who == unique.Handle[holding]{} }

// record decodes a cached key record.
func (v cVal) record() (keyRec, error) {
	var r keyRec
	var err error
	if len(v.b) > 0 && v.b[0] == compactTag {
		// decodeCompact keeps none of its bytes: the copy is made on the
		// stack, and a call's first read allocates no more than it did.
		r, err = decodeCompact([]byte(v.b))
	} else {
		r, err = decodeKey([]byte(v.b))
	}
	if err == nil && !v.whole() {
		h := v.who.Value()
		r.Holder, r.SLease = h.holder, h.slease
	}
	return r, err
}

// bytes is the value in one piece, as decodeKey reads it: for who reads a
// cached value as etcd has it (tx.get, the operators' view), in an
// allocation of its own.
func (v cVal) bytes() []byte {
	if v.whole() {
		return []byte(v.b)
	}
	r, err := v.record()
	if err != nil {
		// Not made by compactForm, so never so; what is cut short reads
		// as cut short.
		return []byte(v.b)
	}
	return appendCompact(nil, &r)
}

// compactRec is val, a key record's value in etcd, as the cache keeps it.
func compactRec(val []byte) cVal {
	r, err := decodeKey(val)
	return compactOf(val, &r, err)
}

// compactOf is compactRec(val) for a val decodeKey has read already, as r
// or err: the watch reads each record once, for its tables and the cache.
func compactOf(val []byte, r *keyRec, err error) cVal {
	if err != nil || len(val) == 0 {
		return cVal{b: string(val)}
	}
	return compactForm(r)
}

// writtenForm is compactRec(val) for val, the JSON of r that this server
// writes, made from r without reading the JSON back (most of a
// write-through's cost). JSON keeps every string of r but one that is not
// UTF-8, which it changes: such a record is read back.
func writtenForm(r *keyRec, val []byte) cVal {
	if !utf8.ValidString(r.Holder) || r.Done != nil && !(utf8.ValidString(r.Done.Node) && utf8.ValidString(r.Done.Err) && utf8.ValidString(r.Done.Next)) {
		return compactRec(val)
	}
	return compactForm(r)
}

// compactForm is r as the cache keeps it.
func compactForm(r *keyRec) cVal {
	var buf [128]byte
	if r.Holder == "" {
		return cVal{b: string(appendCompact(buf[:0], r))}
	}
	rest := *r
	rest.Holder, rest.SLease = "", 0
	return cVal{b: string(appendCompact(buf[:0], &rest)), who: unique.Make(holding{r.Holder, r.SLease})}
}

// fixedField is one of a record's lease ids and times, which take most of
// their 64 bits: they are kept fixed-width.
type fixedField struct {
	bit uint64
	v   *int64
}

// fixedFields are r's fixed-width fields, in the order they are kept.
func fixedFields(r *keyRec) [7]fixedField {
	return [...]fixedField{{cSLease, &r.SLease}, {cAcquired, &r.Acquired}, {cTTL, &r.TTL}, {cClaim, &r.Claim}, {cMaxHold, &r.MaxHold}, {cWaitTTL, &r.WaitTTL}, {cDelay, &r.Delay}}
}

// flag is bit if on, else 0.
func flag(on bool, bit uint64) uint64 {
	if on {
		return bit
	}
	return 0
}

func appendCompact(b []byte, r *keyRec) []byte {
	fixed := fixedFields(r)
	m := flag(r.Holder != "", cHolder) | flag(r.Token != 0, cToken) | flag(r.Lease != 0, cLease) |
		flag(r.Queue != 0, cQueue) | flag(r.Seq != 0, cSeq) | flag(r.Done != nil, cDone)
	for _, f := range fixed {
		m |= flag(*f.v != 0, f.bit)
	}
	b = append(b, compactTag)
	b = binary.AppendUvarint(b, m)
	if m&cHolder != 0 {
		b = appendStr(b, r.Holder)
	}
	if m&cToken != 0 {
		b = binary.AppendUvarint(b, r.Token)
	}
	if m&cLease != 0 {
		b = append(b, r.Lease)
	}
	for _, f := range fixed {
		if m&f.bit != 0 {
			b = binary.LittleEndian.AppendUint64(b, uint64(*f.v))
		}
	}
	if m&cQueue != 0 {
		b = binary.AppendUvarint(b, uint64(r.Queue)) // never below 0: one byte or two
	}
	if m&cSeq != 0 {
		b = binary.AppendUvarint(b, r.Seq)
	}
	if d := r.Done; d != nil {
		dm := flag(d.Node != "", dNode) | flag(d.Token != 0, dToken) | flag(d.OK, dOK) | flag(d.Err != "", dErr) |
			flag(d.At != 0, dAt) | flag(d.Next != "", dNext) | flag(d.Unlock, dUnlock)
		b = binary.AppendUvarint(b, dm)
		if dm&dNode != 0 {
			b = appendStr(b, d.Node)
		}
		if dm&dToken != 0 {
			b = binary.AppendUvarint(b, d.Token)
		}
		if dm&dErr != 0 {
			b = appendStr(b, d.Err)
		}
		if dm&dAt != 0 {
			b = binary.LittleEndian.AppendUint64(b, uint64(d.At))
		}
		if dm&dNext != 0 {
			b = appendStr(b, d.Next)
		}
	}
	return b
}

func appendStr(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

// decodeCompact decodes a key's record as the cache keeps it (decodeKey
// calls it for a value that begins with compactTag).
func decodeCompact(b []byte) (keyRec, error) {
	d := compactReader{b: b[1:]}
	var r keyRec
	m := d.uvarint()
	if m&cHolder != 0 {
		r.Holder = d.str()
	}
	if m&cToken != 0 {
		r.Token = d.uvarint()
	}
	if m&cLease != 0 {
		r.Lease = d.byte()
	}
	for _, f := range fixedFields(&r) {
		if m&f.bit != 0 {
			*f.v = d.fixed()
		}
	}
	if m&cQueue != 0 {
		r.Queue = int(d.uvarint())
	}
	if m&cSeq != 0 {
		r.Seq = d.uvarint()
	}
	if m&cDone != 0 {
		dn := &done{}
		dm := d.uvarint()
		if dm&dNode != 0 {
			dn.Node = d.str()
		}
		if dm&dToken != 0 {
			dn.Token = d.uvarint()
		}
		dn.OK = dm&dOK != 0
		if dm&dErr != 0 {
			dn.Err = d.str()
		}
		if dm&dAt != 0 {
			dn.At = d.fixed()
		}
		if dm&dNext != 0 {
			dn.Next = d.str()
		}
		dn.Unlock = dm&dUnlock != 0
		r.Done = dn
	}
	if d.bad || len(d.b) != 0 {
		return keyRec{}, errCompact
	}
	return r, nil
}

// recJSON is a value as etcd has it, but for the record's X, from the
// cache's bytes of it (cVal.bytes): for who reads the JSON (the operators'
// view).
func recJSON(b []byte) []byte {
	if len(b) == 0 || b[0] != compactTag {
		return b
	}
	r, err := decodeCompact(b)
	if err != nil {
		return nil
	}
	return []byte(encode(&r))
}

// compactReader reads a compact record; a read past its end sets bad and
// reads zeros from then on.
type compactReader struct {
	b   []byte
	bad bool
}

// take is the next n bytes, nil (and bad) if there are fewer.
func (d *compactReader) take(n uint64) []byte {
	if n > uint64(len(d.b)) {
		d.bad, d.b = true, nil
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *compactReader) uvarint() uint64 {
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.bad, d.b = true, nil
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *compactReader) fixed() int64 {
	if v := d.take(8); v != nil {
		return int64(binary.LittleEndian.Uint64(v))
	}
	return 0
}

func (d *compactReader) byte() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *compactReader) str() string { return string(d.take(d.uvarint())) }

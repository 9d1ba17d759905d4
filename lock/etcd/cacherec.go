package etcd

import (
	"encoding/binary"
	"errors"
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
// Every field of keyRec but X is here: a field added to keyRec must be
// added here too (TestCacheRecordCompact fills every field).

const compactTag = 0xc1 // never the first byte of UTF-8 text

// The fields, in the order they follow the mask.
const (
	cHolder = 1 << iota
	cToken
	cLease
	cSLease
	cAcquired
	cTTL
	cClaim
	cMaxHold
	cQueue
	cSeq
	cWaitTTL
	cDelay
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

// compactRec is val, a key record's value in etcd, as the cache keeps it,
// in an allocation of its own.
func compactRec(val []byte) []byte {
	r, err := decodeKey(val)
	if err != nil || len(val) == 0 {
		return append([]byte(nil), val...)
	}
	var buf [128]byte
	b := appendCompact(buf[:0], &r)
	return append(make([]byte, 0, len(b)), b...)
}

func appendCompact(b []byte, r *keyRec) []byte {
	var m uint64
	set := func(bit uint64, on bool) {
		if on {
			m |= bit
		}
	}
	set(cHolder, r.Holder != "")
	set(cToken, r.Token != 0)
	set(cLease, r.Lease != 0)
	set(cSLease, r.SLease != 0)
	set(cAcquired, r.Acquired != 0)
	set(cTTL, r.TTL != 0)
	set(cClaim, r.Claim != 0)
	set(cMaxHold, r.MaxHold != 0)
	set(cQueue, r.Queue != 0)
	set(cSeq, r.Seq != 0)
	set(cWaitTTL, r.WaitTTL != 0)
	set(cDelay, r.Delay != 0)
	set(cDone, r.Done != nil)
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
	// Lease ids and times take most of their 64 bits: fixed width.
	for _, f := range []struct {
		bit uint64
		v   int64
	}{{cSLease, r.SLease}, {cAcquired, r.Acquired}, {cTTL, r.TTL}, {cClaim, r.Claim}, {cMaxHold, r.MaxHold}} {
		if m&f.bit != 0 {
			b = binary.LittleEndian.AppendUint64(b, uint64(f.v))
		}
	}
	if m&cQueue != 0 {
		b = binary.AppendVarint(b, int64(r.Queue))
	}
	if m&cSeq != 0 {
		b = binary.AppendUvarint(b, r.Seq)
	}
	if m&cWaitTTL != 0 {
		b = binary.LittleEndian.AppendUint64(b, uint64(r.WaitTTL))
	}
	if m&cDelay != 0 {
		b = binary.LittleEndian.AppendUint64(b, uint64(r.Delay))
	}
	if d := r.Done; d != nil {
		var dm uint64
		if d.Node != "" {
			dm |= dNode
		}
		if d.Token != 0 {
			dm |= dToken
		}
		if d.OK {
			dm |= dOK
		}
		if d.Err != "" {
			dm |= dErr
		}
		if d.At != 0 {
			dm |= dAt
		}
		if d.Next != "" {
			dm |= dNext
		}
		if d.Unlock {
			dm |= dUnlock
		}
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
	for _, f := range []struct {
		bit uint64
		v   *int64
	}{{cSLease, &r.SLease}, {cAcquired, &r.Acquired}, {cTTL, &r.TTL}, {cClaim, &r.Claim}, {cMaxHold, &r.MaxHold}} {
		if m&f.bit != 0 {
			*f.v = d.fixed()
		}
	}
	if m&cQueue != 0 {
		r.Queue = int(d.varint())
	}
	if m&cSeq != 0 {
		r.Seq = d.uvarint()
	}
	if m&cWaitTTL != 0 {
		r.WaitTTL = d.fixed()
	}
	if m&cDelay != 0 {
		r.Delay = d.fixed()
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

// recJSON is a cached value as etcd has it, but for the record's X: for
// who reads the JSON (the operators' view).
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

type compactReader struct {
	b   []byte
	bad bool
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

func (d *compactReader) varint() int64 {
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.bad, d.b = true, nil
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *compactReader) fixed() int64 {
	if len(d.b) < 8 {
		d.bad, d.b = true, nil
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return int64(v)
}

func (d *compactReader) byte() uint8 {
	if len(d.b) < 1 {
		d.bad = true
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

func (d *compactReader) str() string {
	n := d.uvarint()
	if n > uint64(len(d.b)) {
		d.bad, d.b = true, nil
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

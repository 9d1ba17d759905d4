package memory

// deadlineHeap is an indexed min-heap of entries by their next deadline, so
// that renewing or removing an entry is O(log n) and one timer per shard
// serves every lease in it.
type deadlineHeap []*entry

func (h deadlineHeap) less(i, j int) bool { return h[i].at < h[j].at }

func (h deadlineHeap) swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].hidx = int32(i)
	h[j].hidx = int32(j)
}

func (h *deadlineHeap) push(e *entry) {
	e.hidx = int32(len(*h))
	*h = append(*h, e)
	h.up(len(*h) - 1)
}

func (h *deadlineHeap) remove(e *entry) {
	i := int(e.hidx)
	if i < 0 {
		return
	}
	last := len(*h) - 1
	if i != last {
		h.swap(i, last)
	}
	(*h)[last] = nil
	*h = (*h)[:last]
	e.hidx = -1
	if i != last {
		h.fix(i)
	}
}

func (h deadlineHeap) fix(i int) {
	if !h.down(i) {
		h.up(i)
	}
}

func (h deadlineHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !h.less(i, p) {
			return
		}
		h.swap(i, p)
		i = p
	}
}

func (h deadlineHeap) down(i int) bool {
	start := i
	n := len(h)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		c := l
		if r := l + 1; r < n && h.less(r, l) {
			c = r
		}
		if !h.less(c, i) {
			break
		}
		h.swap(i, c)
		i = c
	}
	return i > start
}

// set moves e to deadline at, or out of the heap when at is zero.
func (h *deadlineHeap) set(e *entry, at mono) {
	e.at = at
	switch {
	case at == 0:
		h.remove(e)
	case e.hidx < 0:
		h.push(e)
	default:
		h.fix(int(e.hidx))
	}
}

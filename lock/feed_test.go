package lock

import (
	"slices"
	"testing"
)

func ready(q *FeedQueue[int]) bool {
	select {
	case <-q.Ready():
		return true
	default:
		return false
	}
}

func TestFeedQueueBound(t *testing.T) {
	var q FeedQueue[int]
	q.Init(3)
	for i := range 3 {
		if !q.Offer(i) {
			t.Fatalf("Offer(%d) refused below the bound", i)
		}
	}
	if q.Offer(3) {
		t.Fatal("Offer past the bound was taken")
	}
	if !ready(&q) {
		t.Fatal("Ready has no token with items waiting")
	}
	if got := q.Take(nil); !slices.Equal(got, []int{0, 1, 2}) {
		t.Fatalf("Take = %v, want the offered items in order", got)
	}
	if got := q.Take(nil); len(got) != 0 {
		t.Fatalf("a second Take = %v, want nothing", got)
	}
	if !q.Offer(4) {
		t.Fatal("Offer refused after Take made room")
	}
}

func TestFeedQueueNotify(t *testing.T) {
	var q FeedQueue[int]
	q.Init(10)
	calls := 0
	q.Notify(func() { calls++ })
	if calls != 0 {
		t.Fatalf("Notify on an empty, open feed called f %d times", calls)
	}
	q.Offer(1)
	q.Offer(2)
	if calls != 1 {
		t.Fatalf("two items offered to an idle feed called f %d times, want once (when items start waiting)", calls)
	}
	q.Take(nil)
	q.Offer(3)
	if calls != 2 {
		t.Fatalf("an item after Take emptied the feed: f called %d times in all, want 2", calls)
	}
	if !q.End() {
		t.Fatal("the first End reported false")
	}
	if calls != 3 {
		t.Fatalf("End called f %d times in all, want 3", calls)
	}
	late := 0
	q.Notify(func() { late++ })
	if late != 1 {
		t.Fatalf("Notify on an ended feed called f %d times, want once at once", late)
	}
}

func TestFeedQueueEndAndSlow(t *testing.T) {
	var q FeedQueue[int]
	q.Init(1)
	if q.Slow() {
		t.Fatal("a new feed is slow")
	}
	if !q.MarkSlow() || q.MarkSlow() {
		t.Fatal("MarkSlow must report true to its first caller only")
	}
	if !q.Slow() {
		t.Fatal("Slow is false after MarkSlow")
	}
	select {
	case <-q.Done():
		t.Fatal("Done closed before End")
	default:
	}
	if !q.End() || q.End() {
		t.Fatal("End must report true to its first caller only")
	}
	<-q.Done()
	if !q.Offer(1) || !q.Offer(2) {
		t.Fatal("Offer to an ended feed must drop the item and report true (the owner has nothing to end)")
	}
	if got := q.Take(nil); len(got) != 0 {
		t.Fatalf("an ended feed queued %v", got)
	}
}

// TestFeedQueueChannelsOnDemand: a feed taken through Notify, Take and
// Ended, as a server takes thousands of idle ones, makes no channel; one
// asked for later behaves as if it had been there from Init.
func TestFeedQueueChannelsOnDemand(t *testing.T) {
	var q FeedQueue[int]
	q.Init(10)
	calls := 0
	q.Notify(func() { calls++ })
	q.Offer(1)
	if got := q.Take(nil); !slices.Equal(got, []int{1}) {
		t.Fatalf("Take = %v", got)
	}
	if q.Ended() {
		t.Fatal("Ended before End")
	}
	q.End()
	if !q.Ended() || calls != 2 {
		t.Fatalf("after End: Ended %v, f called %d times, want true and 2", q.Ended(), calls)
	}
	if q.ready != nil || q.done != nil {
		t.Fatal("a feed taken through Notify, Take and Ended made a channel")
	}
	select {
	case <-q.Done():
	default:
		t.Fatal("Done asked for after End is not closed")
	}

	var r FeedQueue[int]
	r.Init(10)
	r.Offer(1)
	if !ready(&r) {
		t.Fatal("Ready asked for with an item waiting has no token")
	}
	if ready(&r) {
		t.Fatal("Ready holds a second token for one item")
	}
	r.Take(nil)
	r.Offer(2)
	if !ready(&r) {
		t.Fatal("Ready has no token for an item offered after it was made")
	}
	done := r.Done()
	select {
	case <-done:
		t.Fatal("Done closed before End")
	default:
	}
	r.End()
	<-done
}

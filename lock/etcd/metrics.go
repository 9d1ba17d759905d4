package etcd

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The etcd engine's own counters, which a server that serves it exports
// beside the backend's Stats (server: a backend that is a
// prometheus.Collector is registered). They say what the round trips of a
// call were spent on (docs/DESIGN.md, "An etcd backend").
var (
	descConflicts = prometheus.NewDesc("dlock_etcd_transaction_conflicts_total",
		"Transactions of this server whose guards failed (another server, or a stale cache, changed what they read), tried again.", nil, nil)
	descCacheReads = prometheus.NewDesc("dlock_etcd_cache_reads_total",
		"First attempts of a call: result=hit read the watch's cache, result=miss read etcd (a key of a kind the cache does not keep).", []string{"result"}, nil)
	descCacheStale = prometheus.NewDesc("dlock_etcd_cache_stale_total",
		"First attempts that read the cache and found, at their commit or confirmation, that a record had changed: a round trip more.", nil, nil)
	descQueueReads = prometheus.NewDesc("dlock_etcd_queue_reads_total",
		"Reads of a key's queue by this server's transactions (the next waiter of a hand-off, a waiter's place): source=watch the queue its watch keeps, as of the record the call read; source=etcd a read of etcd (the watch had not applied that record yet).", []string{"source"}, nil)
	descRequests = prometheus.NewDesc("dlock_etcd_write_requests_total",
		"etcd requests that carried this server's transactions (writes, and confirmations of answers read from the cache); grouped=true those that carried more than one.", []string{"grouped"}, nil)
	descGroupedTxns = prometheus.NewDesc("dlock_etcd_write_transactions_total",
		"Transactions those requests carried: divided by the requests, the transactions per etcd request.", nil, nil)
	descKeepalives = prometheus.NewDesc("dlock_etcd_keepalives_total",
		"Keepalives of the session leases this server keeps: result=sent on its streams, answered there, checked (a KeepAliveOnce of its own, for a lease whose keepalive held its stream up).", []string{"result"}, nil)
	descKeepaliveStuck = prometheus.NewDesc("dlock_etcd_keepalive_streams_stuck_total",
		"Keepalive streams this server ended because etcd held one keepalive, of a lease that may have run out, for a third of the TTL; that lease is then asked about on its own.", nil, nil)
	descKeepaliveWait = prometheus.NewDesc("dlock_etcd_keepalive_wait_seconds",
		"How long the oldest keepalive on this server's streams has waited for etcd's answer (0: none waits).", nil, nil)
	descThrottled = prometheus.NewDesc("dlock_etcd_throttled_seconds_total",
		"Time this server held its etcd requests back, one at a time or none, because its keepalives waited on etcd (an eighth of a keepalive period or more): the sessions' leases first.", nil, nil)
	descIndexSweeps = prometheus.NewDesc("dlock_etcd_queue_index_sweeps_total",
		"Transactions of this server that deleted the queue indexes a success with many waiters left behind (docs/DESIGN.md, \"Queue indexes a success leaves\").", nil, nil)
	descPromotions = prometheus.NewDesc("dlock_etcd_session_promotions_total",
		"Sessions this server gave a lease of their own (a session-leased hold or wait, or a stream on a second server), which had lived on their server's home lease (docs/DESIGN.md, \"Home leases\").", nil, nil)
	descRehomes = prometheus.NewDesc("dlock_etcd_session_rehomes_total",
		"Sessions this server moved onto its own home lease when their node's stream came here from the server whose home lease they lived on (docs/DESIGN.md, \"Home leases\").", nil, nil)
	descStalled = prometheus.NewDesc("dlock_etcd_stalled_requests_total",
		"Those requests that etcd had not answered within 100 ms, after which the next ones went without waiting for them (a slow or unreachable etcd member).", nil, nil)
)

// Describe implements prometheus.Collector.
func (b *Backend) Describe(ch chan<- *prometheus.Desc) {
	ch <- descConflicts
	ch <- descCacheReads
	ch <- descCacheStale
	ch <- descQueueReads
	ch <- descRequests
	ch <- descGroupedTxns
	ch <- descKeepalives
	ch <- descKeepaliveWait
	ch <- descKeepaliveStuck
	ch <- descStalled
	ch <- descThrottled
	ch <- descIndexSweeps
	ch <- descPromotions
	ch <- descRehomes
}

// Collect implements prometheus.Collector.
func (b *Backend) Collect(ch chan<- prometheus.Metric) {
	hits, misses := b.rc.stats()
	ch <- prometheus.MustNewConstMetric(descConflicts, prometheus.CounterValue, float64(b.conflicts.Load()))
	ch <- prometheus.MustNewConstMetric(descPromotions, prometheus.CounterValue, float64(b.promotions.Load()))
	ch <- prometheus.MustNewConstMetric(descRehomes, prometheus.CounterValue, float64(b.rehomes.Load()))
	ch <- prometheus.MustNewConstMetric(descCacheReads, prometheus.CounterValue, float64(hits), "hit")
	ch <- prometheus.MustNewConstMetric(descCacheReads, prometheus.CounterValue, float64(misses), "miss")
	ch <- prometheus.MustNewConstMetric(descCacheStale, prometheus.CounterValue, float64(b.cacheStale.Load()))
	fromWatch, fromEtcd := b.qs.stats()
	ch <- prometheus.MustNewConstMetric(descQueueReads, prometheus.CounterValue, float64(fromWatch), "watch")
	ch <- prometheus.MustNewConstMetric(descQueueReads, prometheus.CounterValue, float64(fromEtcd), "etcd")
	requests, grouped := b.g.requests.Load(), b.g.grouped.Load()
	ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(requests-grouped), "false")
	ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(grouped), "true")
	ch <- prometheus.MustNewConstMetric(descGroupedTxns, prometheus.CounterValue, float64(b.g.txns.Load()))
	k := b.keeper
	ch <- prometheus.MustNewConstMetric(descKeepalives, prometheus.CounterValue, float64(k.sent.Load()), "sent")
	ch <- prometheus.MustNewConstMetric(descKeepalives, prometheus.CounterValue, float64(k.answers.Load()), "answered")
	ch <- prometheus.MustNewConstMetric(descKeepalives, prometheus.CounterValue, float64(k.checked.Load()), "checked")
	ch <- prometheus.MustNewConstMetric(descKeepaliveStuck, prometheus.CounterValue, float64(k.stuck.Load()))
	_, wait := k.lag(time.Now())
	ch <- prometheus.MustNewConstMetric(descKeepaliveWait, prometheus.GaugeValue, wait.Seconds())
	ch <- prometheus.MustNewConstMetric(descStalled, prometheus.CounterValue, float64(b.g.stalled.Load()))
	ch <- prometheus.MustNewConstMetric(descThrottled, prometheus.CounterValue, time.Duration(b.g.throttled.Load()).Seconds())
	ch <- prometheus.MustNewConstMetric(descIndexSweeps, prometheus.CounterValue, float64(b.ix.sweeps.Load()))
}

package server

import (
	"sync/atomic"

	"github.com/dlock/dlock/lock"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	latency      *prometheus.HistogramVec
	streams      prometheus.Gauge
	fullSockets  prometheus.Counter
	refused      prometheus.Counter
	acceptErrors prometheus.Counter
	panics       prometheus.Counter
	crossSite    prometheus.Counter
}

func newMetrics(reg *prometheus.Registry, m lock.Backend) *metrics {
	mt := &metrics{
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dlock_http_request_duration_seconds",
			Help:    "Time to answer an HTTP request, by endpoint (event streams: until the stream starts).",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1, 10, 60},
		}, []string{"endpoint"}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "dlock_event_streams",
			Help: "Open event streams.",
		}),
	}
	mt.refused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dlock_connections_refused_total",
		Help: "Connections answered 503 overloaded and closed: --max-conns were open, or no file descriptor was left to serve the request an event loop had read.",
	})
	mt.acceptErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dlock_accept_errors_total",
		Help: "Failed accepts (EMFILE, ...), retried after a back-off.",
	})
	mt.panics = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dlock_handler_panics_total",
		Help: "Panics recovered while serving a request; each closed its connection.",
	})
	mt.fullSockets = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dlock_event_stream_full_socket_total",
		Help: "Event stream writes that found the peer's socket full and went on in the stream's own goroutine, waiting up to --write-timeout.",
	})
	mt.crossSite = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dlock_cross_site_refusals_total",
		Help: "Requests refused 403 because a browser sent them for another site (Sec-Fetch-Site, Origin).",
	})
	reg.MustRegister(mt.latency, mt.streams, mt.fullSockets, mt.refused, mt.acceptErrors, mt.panics, mt.crossSite, managerCollector{m}, limitsCollector{m})
	if c, ok := m.(prometheus.Collector); ok {
		// An engine's own counters (the etcd engine's round trips).
		reg.MustRegister(c)
	}
	return mt
}

// watchConns exports the open-connection count, read when scraped.
func (mt *metrics) watchConns(reg *prometheus.Registry, open *atomic.Int64) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "dlock_connections_open",
		Help: "Open client connections, event streams included.",
	}, func() float64 { return float64(open.Load()) }))
}

// managerCollector reads the lock manager's gauges and counters when
// scraped, so the lock hot path never touches a shared metric.
type managerCollector struct{ m lock.Backend }

var (
	descHeld         = prometheus.NewDesc("dlock_locks_held", "Keys with a holder.", nil, nil)
	descQueued       = prometheus.NewDesc("dlock_queued_waiters", "Queue entries over all keys.", nil, nil)
	descKeys         = prometheus.NewDesc("dlock_keys", "Keys in memory: held, queued or with a retained completion.", nil, nil)
	descSessions     = prometheus.NewDesc("dlock_sessions", "Sessions, streaming or in grace.", nil, nil)
	descGrants       = prometheus.NewDesc("dlock_grants_total", "Grants, direct and by hand-off.", nil, nil)
	descHandoffs     = prometheus.NewDesc("dlock_handoffs_total", "Grants by hand-off to a queued node.", nil, nil)
	descExpiries     = prometheus.NewDesc("dlock_expiries_total", "Holds and queue entries ended by their lease.", nil, nil)
	descSessionsLost = prometheus.NewDesc("dlock_sessions_lost_total", "Sessions ended because no stream reopened within the grace while they held or waited for something, which they released.", nil, nil)
	descSessionEnds  = prometheus.NewDesc("dlock_session_ends_total", "Sessions ended, by reason: lost (their grace ran out while they held or waited for something) or closed (their grace ran out with nothing leased: a node that closed its streams and left).", []string{"reason"}, nil)
	descSlowStreams  = prometheus.NewDesc("dlock_slow_streams_total", "Event streams closed for not keeping up.", nil, nil)
)

func (c managerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHeld, descQueued, descKeys, descSessions, descGrants, descHandoffs, descExpiries, descSessionsLost, descSessionEnds, descSlowStreams} {
		ch <- d
	}
}

func (c managerCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.m.Stats()
	gauge := func(d *prometheus.Desc, v int) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v))
	}
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	gauge(descHeld, st.Held)
	gauge(descQueued, st.Queued)
	gauge(descKeys, st.Keys)
	gauge(descSessions, st.Sessions)
	counter(descGrants, st.Grants)
	counter(descHandoffs, st.Handoffs)
	counter(descExpiries, st.Expiries)
	counter(descSessionsLost, st.SessionsLost)
	ch <- prometheus.MustNewConstMetric(descSessionEnds, prometheus.CounterValue, float64(st.SessionsLost), "lost")
	ch <- prometheus.MustNewConstMetric(descSessionEnds, prometheus.CounterValue, float64(st.SessionsClosed), "closed")
	counter(descSlowStreams, st.SlowStreams)
}

// limitsCollector counts what the lock manager's limits refused or cut
// (docs/SECURITY.md).
type limitsCollector struct{ m lock.Backend }

var (
	descLimitRefusals = prometheus.NewDesc("dlock_limit_refusals_total",
		"Requests refused by a limit: sessions (--max-sessions), node_streams (--max-sessions-per-node), queue (--max-queue), keys (--max-keys), watchers (--max-watchers), types (64 type names besides pull, update and delete).",
		[]string{"limit"}, nil)
	descTruncatedErrors = prometheus.NewDesc("dlock_truncated_errors_total", "Unlock error texts cut to 1 KiB.", nil, nil)
	descReplayGaps      = prometheus.NewDesc("dlock_replay_gaps_total", "Stream reconnects whose replay missed events no longer kept.", nil, nil)
)

func (c limitsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descLimitRefusals
	ch <- descTruncatedErrors
	ch <- descReplayGaps
}

func (c limitsCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.m.Stats()
	for limit, v := range map[string]uint64{
		"sessions":     st.RefusedSessions,
		"node_streams": st.RefusedNodeStreams,
		"queue":        st.RefusedQueue,
		"keys":         st.RefusedKeys,
		"watchers":     st.RefusedWatchers,
		"types":        lock.RefusedTypes(), // the process's, as its table of types is
	} {
		ch <- prometheus.MustNewConstMetric(descLimitRefusals, prometheus.CounterValue, float64(v), limit)
	}
	ch <- prometheus.MustNewConstMetric(descTruncatedErrors, prometheus.CounterValue, float64(st.TruncatedErrors))
	ch <- prometheus.MustNewConstMetric(descReplayGaps, prometheus.CounterValue, float64(st.ReplayGaps))
}

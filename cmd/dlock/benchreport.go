package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dlock/dlock/internal/bench"
)

// benchReport is what a run of bench measured, and what it started to
// measure it, to print once every scenario ran.
type benchReport struct {
	// setup says what was measured, when bench started it: printed with
	// the results (docs/BENCHMARKS.md, "dlock on etcd").
	setup   []string
	results []bench.Result
	pings   []bench.PingResult
	cutoff  []bench.CutoffSummary
}

// write prints the report to w: as JSON, as Markdown tables and lists, or
// as aligned tables and lines.
func (rep *benchReport) write(w io.Writer, asJSON, asMarkdown bool) error {
	ratios := benchRatios(rep.results)
	if asJSON {
		return rep.writeJSON(w, ratios)
	}
	lines := append(rep.setup, cpuLines(rep.results)...)
	for _, k := range slices.Sorted(maps.Keys(ratios)) {
		lines = append(lines, fmt.Sprintf("%s = %.2f", k, ratios[k]))
	}
	if asMarkdown {
		rep.writeMarkdown(w, lines)
	} else {
		rep.writeText(w, lines)
	}
	return nil
}

func (rep *benchReport) writeJSON(w io.Writer, ratios map[string]float64) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	out := map[string]any{"results": rep.results, "ratios": ratios}
	if len(rep.setup) > 0 {
		out["setup"] = rep.setup
	}
	if len(rep.pings) > 0 {
		out["pings"] = rep.pings
	}
	if len(rep.cutoff) > 0 {
		out["cutoff"] = rep.cutoff
	}
	return enc.Encode(out)
}

// writeMarkdown prints the tables and then the notes and lines as a list
// (make bench appends them to docs/BENCHMARKS.md).
func (rep *benchReport) writeMarkdown(w io.Writer, lines []string) {
	if len(rep.pings) > 0 {
		fmt.Fprintln(w, "| "+strings.Join(pingColumns, " | ")+" |")
		fmt.Fprintln(w, strings.Repeat("| --- ", len(pingColumns))+"|")
		for _, r := range rep.pings {
			fmt.Fprintln(w, "| "+strings.Join(pingRow(r), " | ")+" |")
		}
		fmt.Fprintln(w)
	}
	if len(rep.results) > 0 {
		fmt.Fprintln(w, "| scenario | system | concurrency | ops/s | p50 | p90 | p99 | max | one op | server CPU/op | server RSS |")
		fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
		for _, r := range rep.results {
			fmt.Fprintf(w, "| %s | %s | %d | %.0f | %s | %s | %s | %s | %s | %s | %s |\n", r.Scenario, r.System, r.Concurrency, r.Rate, us(r.P50), us(r.P90), us(r.P99), us(r.Max), r.Unit, cpuText(r.ServerCPUPerOp), rssText(r))
		}
		fmt.Fprintln(w)
	}
	printCutoff(w, rep.cutoff, true)
	for _, r := range rep.results {
		if r.Note != "" {
			fmt.Fprintf(w, "- %s %s: %s\n", r.Scenario, r.System, r.Note)
		}
	}
	for _, l := range lines {
		fmt.Fprintf(w, "- %s\n", l)
	}
}

// writeText prints the tables aligned, then the notes and lines; the
// results' table, if empty, when nothing else was measured either.
func (rep *benchReport) writeText(w io.Writer, lines []string) {
	if len(rep.pings) > 0 {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, strings.Join(pingColumns, "\t")+"\t")
		for _, r := range rep.pings {
			fmt.Fprintln(tw, strings.Join(pingRow(r), "\t")+"\t")
		}
		tw.Flush()
	}
	if len(rep.results) > 0 || (len(rep.pings) == 0 && len(rep.cutoff) == 0) {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "scenario\tsystem\tconcurrency\tops/s\tp50\tp90\tp99\tmax\tone op\tserver CPU/op\tserver RSS\t")
		for _, r := range rep.results {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.System, r.Concurrency, r.Rate, us(r.P50), us(r.P90), us(r.P99), us(r.Max), r.Unit, cpuText(r.ServerCPUPerOp), rssText(r))
		}
		tw.Flush()
	}
	printCutoff(w, rep.cutoff, false)
	for _, r := range rep.results {
		if r.Note != "" {
			fmt.Fprintf(w, "%s %s: %s\n", r.Scenario, r.System, r.Note)
		}
	}
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
}

// msText prints milliseconds as seconds; "—" for none.
func msText(v float64) string {
	if v <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f s", v/1e3)
}

// printCutoff prints the cutoff scenario's table: per case, the rounds,
// in how many the holder kept its hold, cut → holder stopped and cut →
// next holder running (p50 / max over the rounds the holder stopped in),
// the bound, and the overlap, which must be 0; then every problem.
func printCutoff(w io.Writer, sums []bench.CutoffSummary, markdown bool) {
	if len(sums) == 0 {
		return
	}
	row := func(s bench.CutoffSummary) []string {
		return []string{s.Scenario, fmt.Sprint(s.Rounds), fmt.Sprintf("%d/%d", s.Kept, s.Rounds),
			msText(s.StoppedP50) + " / " + msText(s.StoppedMax), msText(s.NextP50) + " / " + msText(s.NextMax),
			msText(s.Bound), fmt.Sprintf("%.0f ms, %d lines", s.Overlap, s.OverlapLines)}
	}
	head := []string{"cutoff case", "rounds", "hold kept", "cut → holder stopped (p50 / max)", "cut → next holder running (p50 / max)", "bound", "overlap"}
	if markdown {
		fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(head, " | "), strings.Repeat(" --- |", len(head)))
		for _, s := range sums {
			fmt.Fprintf(w, "| %s |\n", strings.Join(row(s), " | "))
		}
		fmt.Fprintln(w)
	} else {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
		for _, s := range sums {
			fmt.Fprintln(tw, strings.Join(row(s), "\t")+"\t")
		}
		tw.Flush()
	}
	for _, s := range sums {
		for _, p := range s.Problems {
			fmt.Fprintf(w, "FAILED %s %s\n", s.Scenario, p)
		}
	}
}

// cutoffFailed is the error of a cutoff run in which a round broke the
// promise: an overlap, a holder that did not stop, a key that did not move
// on within its bound.
func cutoffFailed(sums []bench.CutoffSummary) error {
	var failed []string
	for _, s := range sums {
		if s.Failed() {
			failed = append(failed, s.Scenario)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("cutoff: %s broke the promise: an overlap, a holder that did not stop, or a key that did not move on within its bound (see above)", strings.Join(failed, ", "))
	}
	return nil
}

// pingColumns head the pings scenario's table, a row of which pingRow
// makes: CPU in percent of one core, bytes the streams' payload.
var pingColumns = []string{"ping interval", "streams", "window", "server CPU", "bench CPU", "pings/s", "of expected", "bytes/s", "bytes/s a stream", "bytes a ping", "server CPU a ping"}

func pingRow(r bench.PingResult) []string {
	return []string{msDuration(r.IntervalMS).String(), strconv.Itoa(r.Streams), fmt.Sprintf("%.1fs", r.Seconds),
		fmt.Sprintf("%.2f%%", r.ServerCPU), fmt.Sprintf("%.2f%%", r.BenchCPU),
		fmt.Sprintf("%.0f", r.Rate), fmt.Sprintf("%.2f", r.Rate/r.Expected),
		fmt.Sprintf("%.0f", r.BytesPerSecond), fmt.Sprintf("%.2f", r.BytesPerStream), fmt.Sprintf("%.1f", r.PingBytes), cpuText(r.ServerCPUPerPing)}
}

// msDuration is a duration given in milliseconds.
func msDuration(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

// benchRatios divides dlock's rate by each other system's, and the other
// system's server CPU per op into dlock's, per scenario; and the fan-out's
// times by its floor's: how many times the floor dlock takes to tell every
// waiter, in its worst round and in its median one.
func benchRatios(results []bench.Result) map[string]float64 {
	ratios := map[string]float64{}
	for _, d := range results {
		if d.System != "dlock" {
			continue
		}
		for _, o := range results {
			if o.System == "dlock" || o.Scenario != d.Scenario {
				continue
			}
			if o.Rate > 0 {
				ratios[fmt.Sprintf("%s dlock/%s", d.Scenario, o.System)] = d.Rate / o.Rate
			}
			if d.ServerCPUPerOp > 0 && o.ServerCPUPerOp > 0 {
				ratios[fmt.Sprintf("%s server CPU/op dlock/%s", d.Scenario, o.System)] = d.ServerCPUPerOp / o.ServerCPUPerOp
			}
		}
		if d.Scenario != "fanout" {
			continue
		}
		for _, f := range results {
			if f.Scenario != "fanout-floor" {
				continue
			}
			if f.Max > 0 {
				ratios["fanout max dlock/floor"] = d.Max / f.Max
			}
			if f.RoundMedian > 0 {
				ratios["fanout median round dlock/floor"] = d.RoundMedian / f.RoundMedian
			}
		}
	}
	return ratios
}

// cpuLines puts the server CPU per op of the systems that ran a scenario
// side by side, one line per scenario that more than one ran.
func cpuLines(results []bench.Result) []string {
	var lines []string
	var done []string
	for _, r := range results {
		if slices.Contains(done, r.Scenario) {
			continue
		}
		done = append(done, r.Scenario)
		var parts []string
		for _, o := range results {
			if o.Scenario == r.Scenario && o.ServerCPUPerOp > 0 {
				parts = append(parts, o.System+" "+cpuText(o.ServerCPUPerOp))
			}
		}
		if len(parts) > 1 {
			lines = append(lines, fmt.Sprintf("%s server CPU per %s: %s", r.Scenario, r.Unit, strings.Join(parts, ", ")))
		}
	}
	return lines
}

func cpuText(v float64) string {
	switch {
	case v <= 0:
		return ""
	case v >= 1e3:
		return fmt.Sprintf("%.2fms", v/1e3)
	}
	return fmt.Sprintf("%.1fµs", v)
}

// us formats a latency; none (the memory rows, which time nothing) is
// left blank.
func us(v float64) string {
	switch {
	case v <= 0:
		return ""
	case v >= 1e6:
		return fmt.Sprintf("%.2fs", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.2fms", v/1e3)
	}
	return fmt.Sprintf("%.0fµs", v)
}

func rssText(r bench.Result) string {
	if r.RSSMiB <= 0 {
		return ""
	}
	return fmt.Sprintf("%.1f MiB", r.RSSMiB)
}

package kit

import (
	"fmt"
	"runtime"
	"testing"
)

// Outcome records how a helper that takes a testing.TB ended, by Skipf or
// Fatalf, without ending the real test: for a test that checks that a
// helper refuses, or skips saying why.
type Outcome struct {
	testing.TB
	SkipMsg, FatalMsg string // what Skipf or Fatalf said
}

func (o *Outcome) Helper() {}

func (o *Outcome) Skipf(format string, args ...any) {
	o.SkipMsg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (o *Outcome) Fatalf(format string, args ...any) {
	o.FatalMsg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// Catch runs f with an Outcome over t, in a goroutine of its own so that
// the Goexit of a Skipf or Fatalf ends only f.
func Catch(t testing.TB, f func(tb testing.TB)) *Outcome {
	o := &Outcome{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(o)
	}()
	<-done
	return o
}

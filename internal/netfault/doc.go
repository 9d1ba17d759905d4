// Package netfault makes faults of the network and of processes for tests,
// and always undoes them: every fault a test makes is undone at its
// cleanup, and faults that a killed test run left behind are removed by
// the next run.
//
// Three kinds of fault, each with what it models and what it does not:
//
// A Proxy is a TCP proxy on 127.0.0.1 in front of one target address. A
// test points a client (or a dlock server's etcd client) at the proxy and
// then, at any moment and for every connection open or opened later,
// black-holes it (Blackhole), cuts one direction (Cut), heals it (Heal),
// or resets every connection (CloseAll). A cut direction is neither read
// nor written by the proxy: the sender's bytes fill the kernel's buffers,
// its window closes and its writes block, and no FIN and no RST crosses,
// as on a path whose cable was pulled; a heal delivers the bytes held
// back, in order, as TCP does once a partition ends. What a proxy cannot
// model: the kernel under the proxy completes handshakes and acknowledges
// keepalive probes and the bytes that fit in its buffers, so a dial
// through a black-holed proxy succeeds, and a sender's TCP keepalive or
// retransmission timeout never fires. A test of those uses iptables.
//
// DropAddr and DropOneWay drop packets on loopback with iptables (root
// only; NeedRoot skips, loudly, elsewhere): every packet to and from one
// loopback address other than 127.0.0.1, or one direction between two
// addresses. It is a partition for the kernel too: a dial times out,
// keepalives go unanswered, retransmissions back off, and after the
// rules are removed TCP delivers what was sent. Only the processes that
// use the address are cut off: a client dials from it (DialerFrom), or a
// server listens on it; LoopbackAddr hands a test an address no other
// test uses, and Linux answers on all of 127.0.0.0/8 without any set-up.
// Every rule carries the comment dlock-test-<pid>-<n>, is removed at the
// test's cleanup, and CleanupStale removes the rules of a test process
// that is gone: the package's TestMain calls it, so `make test` (which
// runs every package's tests) removes what a killed run left, and
// NeedRoot calls it once per test binary before the first rule.
//
// Freeze stops a process with SIGSTOP (a machine that froze, a server
// hung in a long pause) until Thaw or the test's cleanup sends SIGCONT.
//
// Each has an entry point for a program that is not a test (dlock bench's
// cutoff scenario), which returns errors instead of failing a test and
// leaves the undoing to its caller: Usable (NeedRoot's check), Drop and
// DropFromTo (DropAddr's and DropOneWay's rules, with the same tags, so
// that CleanupStale removes those of a killed run), ReserveAddr
// (LoopbackAddr), Suspend (Freeze; Thaw undoes both) and ListenProxy
// (NewProxyAt).
//
// Nothing here sleeps to order events: a fault is in place when its call
// returns, and the tests wait for states (a read deadline that passes, a
// process state in /proc).
package netfault

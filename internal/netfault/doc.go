// Package netfault makes faults of the network and of processes for tests,
// and always undoes them: every fault a test makes is undone at its
// cleanup.
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
// retransmission timeout never fires.
//
// Nothing here sleeps to order events: a fault is in place when its call
// returns, and the tests wait for states (a read deadline that passes).
package netfault

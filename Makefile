GO ?= go
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: packagemap test deps vet lint bench bench-etcd bench-pull fuzz build containerd2 image etcd ha-newer-etcd

# test is what CI runs (.ci/run): the test dependencies, formatting, vet,
# staticcheck, then every test with the race detector.
test: deps containerd2 lint
	$(GO) test -race -count=1 ./...
	$(MAKE) ha-newer-etcd
	$(MAKE) fuzz

# ha-newer-etcd runs the tests of three dlock servers on a three-member etcd
# of processes (kills, porcupine, rolling restarts, cut-off nodes) again on
# the etcd that `make etcd` builds (go.mod's version, 3.7), where ./...
# runs them on the etcd in PATH (Debian's 3.4): docs/HA.md advises 3.5 or
# later for a fleet.
HA_ETCD_TESTS = ^(TestHA|TestCutoffEtcd)
ha-newer-etcd: etcd
	PATH="$(CURDIR)/bin:$$PATH" $(GO) test -race -count=1 -run '$(HA_ETCD_TESTS)' ./cmd/dlock

# fuzz runs, briefly, the differential fuzz tests that hold the hand-written
# parsers to net/http and encoding/json (the seeds and committed corpus run
# in every go test too). Each runs a count of inputs, some 10 s of fuzzing
# here, not a duration: with a duration, Go before 1.27 can fail a target
# with a bare "context deadline exceeded" when the time runs out while a
# worker is still on an input (go.dev/issue/75804), a failure of the fuzzer
# and not of the code. FUZZTIME=10m for a longer search by time (that race
# included: a real failure writes its input under testdata/fuzz/).
FUZZTIME ?=
fuzzfor = -fuzztime $(if $(FUZZTIME),$(FUZZTIME),$(1))
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzLeanMatchesNetHTTP$$' $(call fuzzfor,20000x) ./server
	$(GO) test -run '^$$' -fuzz '^FuzzFastMatchesJSON$$' $(call fuzzfor,200000x) ./api
	$(GO) test -run '^$$' -fuzz '^FuzzAuthorization$$' $(call fuzzfor,100000x) ./internal/auth
	$(GO) test -run '^$$' -fuzz '^FuzzBasicMatchesNetHTTP$$' $(call fuzzfor,80000x) ./internal/auth
	$(GO) test -run '^$$' -fuzz '^FuzzRecordMatchesJSON$$' $(call fuzzfor,5000x) ./lock/etcd
	$(GO) test -run '^$$' -fuzz '^FuzzHoldingForms$$' $(call fuzzfor,5000x) ./lock/etcd
	$(GO) test -run '^$$' -fuzz '^FuzzSessionMatchesJSON$$' $(call fuzzfor,20000x) ./lock/etcd
	$(GO) test -run '^$$' -fuzz '^FuzzStreamHeadMatchesNetHTTP$$' $(call fuzzfor,200000x) ./internal/rawhttp

# deps installs, as root, what some tests run for real: Debian's containerd,
# runc and docker-registry (three containerd daemons sharing one store; the
# dlock image pushed, pulled and run by deploy's TestImageContainerd),
# redis-server and etcd-server (dlock bench --compare), chromium (the live
# view's browser test) and systemd for systemd-analyze (deploy/systemd's
# units), openssl and curl (docs/mkcerts.sh, served and called with mTLS;
# deploy/README.md's walks also run etcd-server, containerd and ctr),
# bash-completion (README's `dlock completion bash`, run in bash), and
# iptables (internal/netfault's partitions on loopback addresses; the
# rules a killed run left are removed by the next: by netfault's TestMain,
# and before the first rule of every test binary). Without root those
# tests skip, saying so.
DEB_PACKAGES = containerd runc docker-registry redis-server etcd-server chromium systemd openssl curl iptables bash-completion
deps:
	@if [ "$$(id -u)" = 0 ]; then \
		missing=; for b in containerd ctr runc docker-registry redis-server etcd chromium systemd-analyze openssl curl iptables; do command -v $$b >/dev/null || missing=yes; done; \
		[ -f /usr/share/bash-completion/bash_completion ] || missing=yes; \
		if [ -n "$$missing" ]; then \
			echo "installing $(DEB_PACKAGES) for the tests that run them"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEB_PACKAGES) >/dev/null; \
		fi; \
	else \
		echo "NOTE: not root: the tests with real containerd (deploy: the dlock image is built but NOT run), redis and etcd servers and chromium will be skipped"; \
	fi

# containerd2 builds the containerd 2.x daemon and ctr that the real-daemon
# test (cmd/dlock-content) runs next to Debian's containerd 1.6, from
# containerd's Go module, once per version: into a cache directory outside
# the repository, skipped when the binaries are there. No root needed.
# CGO_ENABLED=0 and the tags drop what needs C or is not used (btrfs,
# devmapper, zfs, CRI, tracing).
CONTAINERD2_VERSION ?= v2.4.2
CONTAINERD2_TAGS = no_btrfs no_devmapper no_zfs no_cri no_tracing urfave_cli_no_docs
export DLOCK_CONTAINERD2_BIN ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/dlock/containerd-$(CONTAINERD2_VERSION)/bin
containerd2:
	@set -e; bin="$(DLOCK_CONTAINERD2_BIN)"; \
	if [ -x "$$bin/containerd" ] && [ -x "$$bin/ctr" ]; then exit 0; fi; \
	echo "building containerd $(CONTAINERD2_VERSION) into $$bin (once; some minutes)"; \
	mkdir -p "$$bin"; tmp=$$(mktemp -d "$$bin/.build.XXXXXX"); trap 'rm -rf "$$tmp"' EXIT; \
	GOBIN="$$tmp" CGO_ENABLED=0 $(GO) install -tags '$(CONTAINERD2_TAGS)' \
		github.com/containerd/containerd/v2/cmd/containerd@$(CONTAINERD2_VERSION) \
		github.com/containerd/containerd/v2/cmd/ctr@$(CONTAINERD2_VERSION); \
	mv "$$tmp/containerd" "$$tmp/ctr" "$$bin/"

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...

lint: vet packagemap
	$(GO) run $(STATICCHECK) ./...

# packagemap holds docs/DEVELOPMENT.md's "Map of the packages" to the tree: one row for
# every package, and no row for a package that is gone.
packagemap:
	@set -e; pkgs=$$($(GO) list ./... | sed 's|^github.com/dlock/dlock/||'); \
	for p in $$pkgs; do grep -q "^| \`$$p\` |" docs/DEVELOPMENT.md || { echo "docs/DEVELOPMENT.md's map of the packages has no row for $$p"; exit 1; }; done; \
	for p in $$(sed -n '/^## Map of the packages/,/^How the parts fit/s/^| `\([a-z][a-z/-]*\)` |.*/\1/p' docs/DEVELOPMENT.md); do \
	  echo "$$pkgs" | grep -qx "$$p" || { echo "docs/DEVELOPMENT.md's map of the packages names $$p, which is not a package"; exit 1; }; done

# bench runs the Go benchmarks, then dlock bench against a fresh local
# server (and Redis and etcd, which it starts): every scenario, the
# fan-out with its floor, and the memory scenario, which starts a fresh
# `dlock serve` of its own for each of its three measurements. It appends
# the numbers, the machine and the commands to docs/BENCHMARKS.md. It
# needs the redis-server and etcd-server packages (make deps installs
# them as root).
BENCH_ADDR ?= 127.0.0.1:7399
BENCH_SCENARIOS = pairs,handoff,fanout,sessions,memory
bench: build
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 3s ./lock/memory ./server ./refcount | tee bin/gobench.txt
	@set -e; out=docs/BENCHMARKS.md; \
	{ echo; echo "## $$(date -u +%F) — make bench"; echo; \
	  echo "Machine: $$(nproc) cores ($$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $$(free -g | awk '/Mem:/{print $$2}') GiB, $$(go version | cut -d' ' -f3)."; echo; \
	  echo '```'; grep -E '^Benchmark' bin/gobench.txt; echo '```'; echo; } >> $$out; \
	bin/dlock serve --listen $(BENCH_ADDR) 2>/dev/null & pid=$$!; sleep 1; \
	echo "\`dlock bench --server http://$(BENCH_ADDR) --scenario $(BENCH_SCENARIOS) --waiters 10000 --compare redis,etcd\`:" >> $$out; echo >> $$out; \
	bin/dlock bench --server http://$(BENCH_ADDR) --scenario $(BENCH_SCENARIOS) --waiters 10000 --compare redis,etcd --markdown >> $$out || { kill $$pid; exit 1; }; \
	kill $$pid; wait $$pid || true

# bench-etcd measures dlock on etcd (docs/BENCHMARKS.md, "dlock on etcd"):
# dlock bench starts one etcd (Debian's etcd-server; its version, fsync and
# data dir's disk are printed), a `dlock serve --backend etcd` on it and,
# with --compare etcd, etcd's own concurrency.Mutex on the same etcd; then
# the fan-out on that server and the fail-over scenario (three servers on
# one etcd, one SIGKILLed under a node each round). Appended to
# docs/BENCHMARKS.md.
BENCH_ETCD_WAITERS ?= 10000
bench-etcd: build
	@set -e; out=docs/BENCHMARKS.md; \
	{ echo; echo "## $$(date -u +%F) — make bench-etcd"; echo; \
	  echo "Machine: $$(nproc) cores ($$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $$(free -g | awk '/Mem:/{print $$2}') GiB, $$(go version | cut -d' ' -f3)."; echo; \
	  echo "\`dlock bench --backend etcd --scenario pairs,handoff,fanout,failover --waiters $(BENCH_ETCD_WAITERS) --compare etcd\`:"; echo; } >> $$out; \
	bin/dlock bench --backend etcd --scenario pairs,handoff,fanout,failover --waiters $(BENCH_ETCD_WAITERS) --compare etcd --markdown >> $$out

# etcd builds etcd's own server, at the version go.mod pins (the embedded
# test servers' own), into bin/etcd: for `dlock bench --etcd bin/etcd` on an
# etcd newer than Debian's 3.4, whose keepalives cost a fleet far more
# (docs/PERFORMANCE.md, "On etcd").
etcd:
	$(GO) build -o bin/etcd ./internal/etcdtest/etcd

# bench-pull measures shared pulls with real daemons, as root: Debian's
# containerd 1.6 pulling random images from docker-registry through one
# throttled uplink for all nodes, one node alone, DLOCK_PULL_NODES nodes
# sharing a store through dlock-content, and as many with a store each
# (BenchmarkSharedPull in cmd/dlock-content). Its table and the timeline of
# one waited-for layer are appended to docs/BENCHMARKS.md. Layers of
# DLOCK_PULL_LAYER_MIB MiB (a fraction too), an uplink of
# DLOCK_PULL_UPLINK_MIB MiB/s; DLOCK_PULL_MODES picks among
# single,shared,separate.
DLOCK_PULL_IMAGES ?= 4
DLOCK_PULL_LAYERS ?= 8
DLOCK_PULL_LAYER_MIB ?= 4
DLOCK_PULL_NODES ?= 3
DLOCK_PULL_UPLINK_MIB ?= 16
DLOCK_PULL_MODES ?= single,shared,separate
BENCH_PULL_ENV = DLOCK_PULL_IMAGES=$(DLOCK_PULL_IMAGES) DLOCK_PULL_LAYERS=$(DLOCK_PULL_LAYERS) DLOCK_PULL_LAYER_MIB=$(DLOCK_PULL_LAYER_MIB) DLOCK_PULL_NODES=$(DLOCK_PULL_NODES) DLOCK_PULL_UPLINK_MIB=$(DLOCK_PULL_UPLINK_MIB) DLOCK_PULL_MODES=$(DLOCK_PULL_MODES)
BENCH_PULL_ARGS = -run '^$$' -bench '^BenchmarkSharedPull$$' -benchtime 1x -timeout 60m ./cmd/dlock-content
BENCH_PULL_OUT ?= docs/BENCHMARKS.md
bench-pull:
	@set -e; mkdir -p bin; out=$(BENCH_PULL_OUT); \
	$(BENCH_PULL_ENV) $(GO) test $(BENCH_PULL_ARGS) 2>&1 | tee bin/pullbench.txt; \
	if ! grep -q '^BenchmarkSharedPull.*ns/op' bin/pullbench.txt || ! grep -q '^ok' bin/pullbench.txt; then \
		echo "bench-pull: the benchmark did not run through (above); $$out is unchanged"; exit 1; fi; \
	{ echo; echo "## $$(date -u +%F) — make bench-pull"; echo; \
	  echo "Machine: $$(nproc) cores ($$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $$(free -g | awk '/Mem:/{print $$2}') GiB, $$(go version | cut -d' ' -f3)."; echo; \
	  echo "\`$(BENCH_PULL_ENV) go test $(BENCH_PULL_ARGS)\`:"; echo; \
	  echo '```text'; grep -vE '^(goos|goarch|pkg|cpu): |^PASS$$|^ok |^--- BENCH: |^    [a-z0-9_]+_test\.go:[0-9]+: ' bin/pullbench.txt; echo '```'; } >> $$out

build:
	@mkdir -p bin
	$(GO) build -o bin/dlock ./cmd/dlock
	$(GO) build -o bin/dlock-content ./cmd/dlock-content

# image builds the dlock image without a container engine or a base image
# (deploy/cmd/dlock-image): static dlock and dlock-content for each of
# IMAGE_PLATFORMS, as an OCI layout in IMAGE_OUT (replaced), and pushed to
# PUSH=REGISTRY/REPOSITORY:TAG when given. The same commit gives the same
# digest (deploy/README.md, "The image").
IMAGE_OUT ?= bin/image
IMAGE_PLATFORMS ?= linux/amd64,linux/arm64
image:
	cd deploy && $(GO) run ./cmd/dlock-image --repo .. --platform $(IMAGE_PLATFORMS) \
		--oci-layout $(abspath $(IMAGE_OUT))$(if $(PUSH), --push $(PUSH))

# deploy/ is a module of its own (its tests need the Kubernetes libraries,
# which dlock itself does not): its manifests and systemd units are checked
# by its tests, and its code linted, as part of test and lint.
.PHONY: deploy-test deploy-lint
test: deploy-test
lint: deploy-lint
deploy-test: deps deploy-lint
	cd deploy && $(GO) test -race -count=1 -timeout 30m ./...
deploy-lint:
	cd deploy && $(GO) vet ./... && $(GO) run $(STATICCHECK) ./...

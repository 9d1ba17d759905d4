GO ?= go
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test deps vet lint bench fuzz build

# test is what CI runs (.ci/run): the test dependencies, formatting, vet,
# staticcheck, then every test with the race detector.
test: deps lint
	$(GO) test -race -count=1 ./...

# deps installs, as root, what some tests run for real: Debian's containerd
# and docker-registry (three containerd daemons sharing one store) and
# redis-server and etcd-server (dlock bench --compare). Without root those
# tests skip, saying so.
DEB_PACKAGES = containerd docker-registry redis-server etcd-server
deps:
	@if [ "$$(id -u)" = 0 ]; then \
		missing=; for b in containerd ctr docker-registry redis-server etcd; do command -v $$b >/dev/null || missing=yes; done; \
		if [ -n "$$missing" ]; then \
			echo "installing $(DEB_PACKAGES) for the tests that run them"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEB_PACKAGES) >/dev/null; \
		fi; \
	else \
		echo "NOTE: not root: the tests with real containerd, redis and etcd servers will be skipped"; \
	fi

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...

lint: vet
	$(GO) run $(STATICCHECK) ./...

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 3s ./lock ./server ./refcount

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzParseLock -fuzztime 30s ./internal/wire
	$(GO) test -run '^$$' -fuzz FuzzParseUnlock -fuzztime 30s ./internal/wire
	$(GO) test -run '^$$' -fuzz FuzzFastMatchesJSON -fuzztime 30s ./internal/wire

build:
	$(GO) build -o bin/dlock ./cmd/dlock
	$(GO) build -o bin/dlock-content ./cmd/dlock-content

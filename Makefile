GO ?= go
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test deps vet lint bench fuzz build

# test is what CI runs (.ci/run): the test dependencies, formatting, vet,
# staticcheck, then every test with the race detector.
test: deps lint
	$(GO) test -race -count=1 ./...

# deps installs what the tests with a real containerd need (Debian's
# containerd and docker-registry) when run as root; without root those
# tests skip, saying so.
deps:
	@if [ "$$(id -u)" = 0 ]; then \
		missing=; for b in containerd ctr docker-registry; do command -v $$b >/dev/null || missing=yes; done; \
		if [ -n "$$missing" ]; then \
			echo "installing containerd and docker-registry for the containerd tests"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd docker-registry >/dev/null; \
		fi; \
	else \
		echo "NOTE: not root: TestRealContainerd (three real containerd daemons) will be skipped"; \
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

build:
	$(GO) build -o bin/dlock ./cmd/dlock
	$(GO) build -o bin/dlock-content ./cmd/dlock-content

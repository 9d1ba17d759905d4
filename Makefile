GO ?= go
STATICCHECK_VERSION ?= latest

.PHONY: test vet lint bench fuzz build

# test: everything CI runs. It installs what the tests need first.
test: vet
	$(GO) test -race -count=1 ./...

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...

lint: vet
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./lock ./server

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzParseLock -fuzztime 30s ./internal/wire
	$(GO) test -run '^$$' -fuzz FuzzParseUnlock -fuzztime 30s ./internal/wire

build:
	$(GO) build -o bin/dlock ./cmd/dlock

GO ?= go
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test vet lint bench fuzz build

# test is what CI runs (.ci/run): formatting, vet, staticcheck, then every
# test with the race detector. It needs Go and the Go module proxy only.
test: lint
	$(GO) test -race -count=1 ./...

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

package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// binaries are the commands of the repository that the image holds: the
// server, its entrypoint, and the containerd content plugin, which
// deploy/kubernetes/content runs from the same image.
var binaries = []string{"dlock", "dlock-content"}

// source is what the image says about the tree it was built from.
type source struct {
	// Revision is the commit checked out (its full hash).
	Revision string
	// Version is `git describe --tags --always --dirty`: the commit's tag or
	// short hash, "-dirty" when tracked files differ from it.
	Version string
	// Created is every timestamp in the image: SOURCE_DATE_EPOCH when set
	// (https://reproducible-builds.org/specs/source-date-epoch/), else the
	// commit's time, so that one commit always gives one digest.
	Created time.Time
}

func readSource(ctx context.Context, repo string) (source, error) {
	var s source
	var err error
	if s.Revision, err = git(ctx, repo, "rev-parse", "HEAD"); err != nil {
		return s, err
	}
	if s.Version, err = git(ctx, repo, "describe", "--tags", "--always", "--dirty"); err != nil {
		return s, err
	}
	epoch, from := os.Getenv("SOURCE_DATE_EPOCH"), "SOURCE_DATE_EPOCH"
	if epoch == "" {
		if epoch, err = git(ctx, repo, "log", "-1", "--format=%ct"); err != nil {
			return s, err
		}
		from = "the commit time"
	}
	sec, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil || sec < 0 {
		return s, fmt.Errorf("%s %q is not a count of seconds since 1970", from, epoch)
	}
	s.Created = time.Unix(sec, 0).UTC()
	return s, nil
}

func git(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s in %s: %w: %s", strings.Join(args, " "), dir, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return strings.TrimSpace(string(out)), nil
}

// compile builds the binaries for one platform and reads them. The flags
// make the result depend on the source and the Go toolchain only: static
// (CGO_ENABLED=0, so it runs on the empty base), no path of this machine
// (-trimpath), no VCS stamp (the image's labels carry the revision; the
// stamp would change with files git does not track), the baseline
// instruction set whatever GOAMD64 or GOARM64 the caller set, and none of
// the caller's GOFLAGS (-race would need cgo).
func compile(ctx context.Context, repo, tmp string, p v1.Platform) (map[string][]byte, error) {
	out := filepath.Join(tmp, p.OS+"-"+p.Architecture)
	args := []string{"build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", out + string(filepath.Separator)}
	for _, b := range binaries {
		args = append(args, "./cmd/"+b)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Architecture,
		"GOFLAGS=", "GOAMD64=v1", "GOARM64=v8.0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build for %s: %w\n%s", p, err, out)
	}
	bins := map[string][]byte{}
	for _, b := range binaries {
		data, err := os.ReadFile(filepath.Join(out, b))
		if err != nil {
			return nil, err
		}
		bins[b] = data
	}
	return bins, nil
}

// Command dlock-image builds dlock's container image without a container
// engine or a base image: the static binaries dlock and dlock-content,
// compiled from the repository for each platform, in one layer on an empty
// base, with an OCI image index over the platforms. It writes an OCI layout
// directory, pushes to a registry, or both. The same commit gives the same
// digest: every timestamp is SOURCE_DATE_EPOCH or else the commit's time.
//
// `make image` runs it (deploy/README.md, "The image").
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// errUsage is a command line that asks for nothing or for something wrong.
var errUsage = errors.New("usage")

type options struct {
	repo      string
	platforms []v1.Platform
	layout    string
	push      string
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dlock-image:", err)
		if errors.Is(err, errUsage) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

func parse(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("dlock-image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.repo, "repo", "", `the dlock repository to build ("": the git work tree around the current directory)`)
	platforms := fs.String("platform", "linux/amd64,linux/arm64", "the platforms, comma-separated, each os/arch")
	fs.StringVar(&o.layout, "oci-layout", "", "write the image index as an OCI layout into this directory (replaced if it holds one already)")
	fs.StringVar(&o.push, "push", "", "push the image index to this reference (REGISTRY/REPOSITORY:TAG), with the credentials of ~/.docker/config.json; a registry on a loopback or private address is spoken to over plain HTTP")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	if o.layout == "" && o.push == "" {
		return o, fmt.Errorf("%w: give --oci-layout DIR, --push REF or both", errUsage)
	}
	for p := range strings.SplitSeq(*platforms, ",") {
		pl, err := v1.ParsePlatform(strings.TrimSpace(p))
		if err != nil || pl.OS != "linux" || pl.Architecture == "" || pl.Variant != "" {
			return o, fmt.Errorf("%w: --platform %q: want linux/ARCH", errUsage, p)
		}
		o.platforms = append(o.platforms, *pl)
	}
	return o, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parse(args, stderr)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	var ref name.Reference
	if o.push != "" {
		// Checked before the minutes of compiling.
		if ref, err = name.ParseReference(o.push); err != nil {
			return fmt.Errorf("%w: --push: %v", errUsage, err)
		}
	}
	if o.repo == "" {
		if o.repo, err = git(ctx, ".", "rev-parse", "--show-toplevel"); err != nil {
			return err
		}
	}
	src, err := readSource(ctx, o.repo)
	if err != nil {
		return err
	}
	log.Info("building", "revision", src.Revision, "version", src.Version, "created", src.Created, "platforms", o.platforms)
	idx, err := build(ctx, o.repo, src, o.platforms, log)
	if err != nil {
		return err
	}
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	if o.layout != "" {
		if err := writeLayout(o.layout, idx, src.Version); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s: OCI layout, image index %s (%s)\n", o.layout, d, platformList(o.platforms))
	}
	if ref != nil {
		err := remote.WriteIndex(ref, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain))
		if err != nil {
			return fmt.Errorf("push %s: %w", ref, err)
		}
		fmt.Fprintf(stdout, "pushed %s@%s\n", ref, d)
	}
	return nil
}

func platformList(ps []v1.Platform) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}

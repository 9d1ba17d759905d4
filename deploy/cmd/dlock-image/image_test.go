package main

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var testSource = source{
	Revision: "0123456789abcdef0123456789abcdef01234567",
	Version:  "v1.2.3",
	Created:  time.Unix(1700000000, 0).UTC(),
}

func testBins(s string) map[string][]byte {
	return map[string][]byte{"dlock": []byte("dlock " + s), "dlock-content": []byte("dlock-content " + s)}
}

func testIndex(t *testing.T, src source, s string) v1.ImageIndex {
	t.Helper()
	var adds []mutate.IndexAddendum
	for _, p := range []v1.Platform{{OS: "linux", Architecture: "amd64"}, {OS: "linux", Architecture: "arm64"}} {
		img, err := platformImage(p, testBins(s+p.Architecture), src)
		if err != nil {
			t.Fatal(err)
		}
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
	}
	return index(adds, src)
}

func digest(t *testing.T, idx v1.ImageIndex) v1.Hash {
	t.Helper()
	d, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// The same binaries and source give the same digest; a change of either
// gives another (so the comparison above can fail).
func TestDigestReproducible(t *testing.T) {
	a, b := digest(t, testIndex(t, testSource, "x")), digest(t, testIndex(t, testSource, "x"))
	if a != b {
		t.Fatalf("two builds of the same input: %s and %s", a, b)
	}
	later := testSource
	later.Created = later.Created.Add(time.Second)
	for name, d := range map[string]v1.Hash{
		"other binaries": digest(t, testIndex(t, testSource, "y")),
		"other time":     digest(t, testIndex(t, later, "x")),
	} {
		if d == a {
			t.Errorf("%s: the same digest %s", name, d)
		}
	}
}

func TestImageConfigAndLayer(t *testing.T) {
	idx := testIndex(t, testSource, "x")
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 2 || m.Annotations["org.opencontainers.image.revision"] != testSource.Revision {
		t.Fatalf("index: %d manifests, annotations %v", len(m.Manifests), m.Annotations)
	}
	for _, desc := range m.Manifests {
		img, err := idx.Image(desc.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != desc.Platform.Architecture || cf.OS != "linux" {
			t.Errorf("%s: config says %s/%s", desc.Platform, cf.OS, cf.Architecture)
		}
		c := cf.Config
		if c.User != "65532:65532" || !slices.Equal(c.Entrypoint, []string{"/usr/local/bin/dlock", "serve"}) ||
			!slices.Contains(c.Env, "DLOCK_LISTEN=0.0.0.0:7380") || !slices.Contains(c.Env, "DLOCK_DATA_DIR=/var/lib/dlock") {
			t.Errorf("%s: config %+v", desc.Platform, c)
		}
		if !cf.Created.Equal(testSource.Created) || c.Labels["org.opencontainers.image.created"] != "2023-11-14T22:13:20Z" ||
			c.Labels["org.opencontainers.image.version"] != "v1.2.3" {
			t.Errorf("%s: created %s, labels %v", desc.Platform, cf.Created, c.Labels)
		}
		layers, err := img.Layers()
		if err != nil || len(layers) != 1 {
			t.Fatalf("%s: %d layers, %v", desc.Platform, len(layers), err)
		}
		got := readLayer(t, layers[0])
		want := map[string]string{
			"usr/": "dir 755 0:0", "usr/local/": "dir 755 0:0", "usr/local/bin/": "dir 755 0:0",
			"usr/local/bin/dlock":         "file 755 0:0 dlock x" + desc.Platform.Architecture,
			"usr/local/bin/dlock-content": "file 755 0:0 dlock-content x" + desc.Platform.Architecture,
			"var/":                        "dir 755 0:0", "var/lib/": "dir 755 0:0", "var/lib/dlock/": "dir 700 65532:65532",
		}
		if len(got) != len(want) {
			t.Errorf("%s: layer has %v", desc.Platform, got)
		}
		for name, w := range want {
			if got[name] != w {
				t.Errorf("%s: %s is %q, want %q", desc.Platform, name, got[name], w)
			}
		}
	}
}

// readLayer describes each entry, checking that every header carries the
// source's time and no owner name.
func readLayer(t *testing.T, l v1.Layer) map[string]string {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got := map[string]string{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return got
		}
		if err != nil {
			t.Fatal(err)
		}
		if !h.ModTime.Equal(testSource.Created) || h.Uname != "" || h.Gname != "" {
			t.Errorf("%s: time %s, owner %q:%q", h.Name, h.ModTime, h.Uname, h.Gname)
		}
		body, _ := io.ReadAll(tr)
		kind := "dir"
		if h.Typeflag == tar.TypeReg {
			kind = "file"
		}
		got[h.Name] = fmt.Sprintf("%s %o %d:%d", kind, h.Mode, h.Uid, h.Gid)
		if kind == "file" {
			got[h.Name] += " " + string(body)
		}
	}
}

func TestWriteLayout(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "image")
	for _, s := range []string{"x", "y"} {
		idx := testIndex(t, testSource, s)
		if err := writeLayout(dir, idx, "v1.2.3"); err != nil {
			t.Fatal(err)
		}
		p, err := layout.FromPath(dir)
		if err != nil {
			t.Fatal(err)
		}
		top, err := p.ImageIndex()
		if err != nil {
			t.Fatal(err)
		}
		m, err := top.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Manifests) != 1 || m.Manifests[0].Digest != digest(t, idx) ||
			m.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "v1.2.3" {
			t.Fatalf("index.json after writing %s: %+v", digest(t, idx), m.Manifests)
		}
	}
	// The second write replaced the first: no blob of "x" is left.
	blobs, err := os.ReadDir(filepath.Join(dir, "blobs", "sha256"))
	if err != nil {
		t.Fatal(err)
	}
	if len(blobs) != 7 { // index, 2 × (manifest, config, layer)
		t.Errorf("%d blobs after two writes, want 7", len(blobs))
	}

	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "notes.txt"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := writeLayout(other, testIndex(t, testSource, "x"), "v1"); !errors.Is(err, errLayout) {
		t.Fatalf("writing over a directory of other files: %v, want %v", err, errLayout)
	}
	if _, err := os.Stat(filepath.Join(other, "notes.txt")); err != nil {
		t.Fatalf("the other directory's file: %v", err)
	}
}

func TestParse(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"--oci-layout", "x", "extra"},
		{"--oci-layout", "x", "--platform", "linux/arm/v7"},
		{"--oci-layout", "x", "--platform", "windows/amd64"},
	} {
		if _, err := parse(args, io.Discard); !errors.Is(err, errUsage) {
			t.Errorf("%q: %v, want %v", args, err, errUsage)
		}
	}
	o, err := parse([]string{"--push", "r/x:y"}, io.Discard)
	if err != nil || len(o.platforms) != 2 || o.platforms[0].Architecture != "amd64" || o.platforms[1].Architecture != "arm64" {
		t.Fatalf("defaults: %+v, %v", o, err)
	}
}

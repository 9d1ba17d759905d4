package doctest

import "testing"

const page = "# Title\n\n## A section\n\n<!-- run: cmd/dlock TestX -->\n```sh\necho one\n# not a heading\n```\n\n```\nplain\n```\n\n## Next\n\n<!-- run: server TestY -->\n```console\n$ curl -s x \\\n  -d y\n{\"a\":1}\n$ true\n```\n"

func TestParse(t *testing.T) {
	bs, err := Parse("p.md", []byte(page))
	if err != nil {
		t.Fatal(err)
	}
	if len(bs) != 3 {
		t.Fatalf("%d blocks, want 3: %+v", len(bs), bs)
	}
	if b := bs[0]; b.Lang != "sh" || b.Dir != "cmd/dlock" || b.Test != "TestX" || b.Section != "A section" || b.Text != "echo one\n# not a heading\n" || b.Line != 6 {
		t.Errorf("first block: %+v", b)
	}
	if b := bs[1]; b.Lang != "" || b.Test != "" || b.Shell() {
		t.Errorf("plain block: %+v", b)
	}
	b := bs[2]
	if b.Section != "Next" || b.Test != "TestY" || !b.Shell() {
		t.Errorf("console block: %+v", b)
	}
	steps := b.Steps()
	if len(steps) != 2 || steps[0].Cmd != "curl -s x \\\n  -d y" || steps[0].Out != "{\"a\":1}\n" || steps[1].Cmd != "true" || steps[1].Out != "" || steps[0].Line != 19 {
		t.Errorf("steps: %+v", steps)
	}
	if m := Marked(bs, "TestY"); len(m) != 1 || m[0].Line != b.Line {
		t.Errorf("Marked: %+v", m)
	}
}

func TestParseRefuses(t *testing.T) {
	for _, bad := range []string{
		"<!-- run: TestX -->\n```sh\nx\n```\n",
		"```sh\nnever closed\n",
	} {
		if _, err := Parse("p.md", []byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	// A marker not right above a fence marks nothing.
	bs, err := Parse("p.md", []byte("<!-- run: a TestA -->\n\n```sh\nx\n```\n"))
	if err != nil || len(bs) != 1 || bs[0].Test != "" {
		t.Errorf("%+v %v", bs, err)
	}
}

func TestSlug(t *testing.T) {
	for h, want := range map[string]string{
		"The holder stops first: the client-side lease": "the-holder-stops-first-the-client-side-lease",
		"systemd: three servers on etcd":                "systemd-three-servers-on-etcd",
		"Load generator (`dlock bench`)":                "load-generator-dlock-bench",
		"2026-11-26 — Fleet scale on etcd":              "2026-11-26--fleet-scale-on-etcd",
	} {
		if got := slug(h); got != want {
			t.Errorf("slug(%q) = %q, want %q", h, got, want)
		}
	}
}

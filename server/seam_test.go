package server

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestServerUsesTheBackendOnly: the server holds no lock state and knows no
// engine, only the contract in package lock (lock.Backend, lock.Inspector;
// docs/DESIGN.md, "The Backend seam"), so a backend plugs in without
// touching it: no file of the server imports a package below lock/.
func TestServerUsesTheBackendOnly(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	checked, contract := 0, false
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if path == lockPkg {
				contract = true
			}
			if strings.HasPrefix(path, lockPkg+"/") {
				t.Errorf("%s: server imports %s; it may use package lock's contract only", fset.Position(imp.Pos()), path)
			}
		}
	}
	if checked == 0 || !contract {
		t.Fatalf("checked %d files, importing %s: %v; the check looks at nothing", checked, lockPkg, contract)
	}
}

const lockPkg = "github.com/dlock/dlock/lock"

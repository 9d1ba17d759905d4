package main

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/lock"
)

const tokenUsage = `usage: dlock token new NODE_ID

Prints a line for the token file of dlock serve --token-file: a fresh
random token (32 bytes from the system's random source, base64url) and
NODE_ID. NODE_ID "*" makes an operator's token, which may act as any node
and read /metrics and /ui. Append the line to the token file and send the
server SIGHUP; give the token to the node in a file (--token-file of the
client commands), never on a command line.
`

// cmdToken is `dlock token new NODE_ID`.
func cmdToken(args []string, stdout, stderr io.Writer) error {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "-help" || args[0] == "--help") {
		fmt.Fprint(stdout, tokenUsage)
		return nil
	}
	if len(args) != 2 || args[0] != "new" {
		fmt.Fprint(stderr, tokenUsage)
		return usageError{errors.New("token: want `dlock token new NODE_ID`")}
	}
	node := args[1]
	if node != auth.Operator {
		if err := lock.ValidateNode(node); err != nil {
			return usageError{err}
		}
		if strings.TrimSpace(node) != node || strings.HasPrefix(node, "#") {
			// The token file's reader trims white space around the node
			// id; a line would name another node than the one asked for.
			return usageError{fmt.Errorf("token: node id %q begins or ends with white space or begins with #", node)}
		}
	}
	_, err := fmt.Fprintf(stdout, "%s %s\n", auth.NewToken(), node)
	return err
}

package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/lock"
	"github.com/spf13/cobra"
)

// tokenCommand is `dlock token new NODE_ID`.
func (e *cli) tokenCommand() *cobra.Command {
	token := &cobra.Command{
		Use:   "token new NODE_ID",
		Short: "Make bearer tokens for the server's --token-file",
		Long: `token new prints a line for the token file of dlock serve --token-file: a fresh
random token and NODE_ID (docs/SECURITY.md).`,
		Example: `  dlock token new node-1 >> /etc/dlock/tokens`,
		Args:    noArgsBut("new NODE_ID"),
		RunE: e.action(func(cmd *cobra.Command, _ []string) error {
			return usageError{errors.New("token: want dlock token new NODE_ID (see dlock token --help)")}
		}),
	}
	newCmd := &cobra.Command{
		Use:   "new NODE_ID",
		Short: "Print a fresh token line TOKEN NODE_ID for the server's --token-file",
		Long: `new prints a line for the token file of dlock serve --token-file: a fresh
random token (32 bytes from the system's random source, base64url) and
NODE_ID. NODE_ID "*" makes an operator's token, which may act as any node
and read /metrics and /ui. Append the line to the token file and send the
server SIGHUP; give the token to the node in a file (--token-file of the
client commands, which then take the line's NODE_ID as their --node),
never on a command line.`,
		Example: `  dlock token new node-1 >> /etc/dlock/tokens
  dlock token new '*' >> /etc/dlock/tokens`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usageError{fmt.Errorf("token new takes one NODE_ID, got %d arguments: want dlock token new NODE_ID", len(args))}
			}
			return nil
		},
		RunE: e.action(func(cmd *cobra.Command, args []string) error {
			node := args[0]
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
			_, err := fmt.Fprintf(e.stdout, "%s %s\n", auth.NewToken(), node)
			return err
		}),
	}
	token.AddCommand(newCmd)
	return token
}

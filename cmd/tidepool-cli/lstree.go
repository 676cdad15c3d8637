package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/tidepool-dev/tidepool/casstore"
)

func init() { commands = append(commands, newLsTreeCommand) }

func newLsTreeCommand(a *app) *cobra.Command {
	var recursive bool
	cmd := &cobra.Command{
		Use:   "ls-tree [-r] ROOT|FORK [PATH]",
		Short: "List the entries of a tree",
		Long: `List the entries of a root's top tree, or of the directory PATH inside it, one
line per entry: MODE HASH PATH, with MODE as six octal digits (040000 directory,
100644 file, 100755 executable, 120000 symlink) and PATH relative to the root.
With -r, list every entry below, directories included, depth-first in tree order.
Paths holding control characters, '"' or '\' are printed as quoted Go strings.`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			s, t, err := a.target(ctx, args[0])
			if err != nil {
				return err
			}
			p := ""
			if len(args) == 2 {
				p = args[1]
			}
			start, rel, err := lookupPath(s, t.Root, p)
			if err != nil {
				return err
			}
			// A tree past the limits, or one that cannot be read, is refused before
			// anything is printed (Measure reads each distinct tree once); the listing
			// itself is streamed, and stops at SIGINT/SIGTERM.
			if start.Mode.IsDir() && recursive {
				if _, err := casstore.Measure(ctx, s, start.Hash, a.limits, false); err != nil {
					if errors.Is(err, casstore.ErrTreeLimit) {
						return fmt.Errorf("ls-tree -r %s: %w", args[0], err)
					}
					return err
				}
			}
			out := bufio.NewWriterSize(cmd.OutOrStdout(), 64<<10)
			if !start.Mode.IsDir() {
				printEntry(out, start, rel)
			} else if err := listTree(ctx, s, casstore.NewBudget(ctx, a.limits), out, start.Hash, rel, recursive, 1); err != nil {
				out.Flush()
				return err
			}
			return out.Flush()
		},
	}
	cmd.Flags().BoolVarP(&recursive, "recursive", "r", false, "list subdirectories recursively")
	return cmd
}

func listTree(ctx context.Context, s *casstore.Store, b *casstore.Budget, out io.Writer, h casstore.Hash, dir string, recursive bool, depth int) error {
	if err := b.Depth(depth); err != nil {
		return fmt.Errorf("ls-tree at %s: %w", displayPath(dir), err)
	}
	t, err := s.ReadTree(h)
	if err != nil {
		return fmt.Errorf("read tree %s at %s: %w", h, displayPath(dir), err)
	}
	if err := b.Entries(len(t)); err != nil {
		return fmt.Errorf("ls-tree at %s: %w", displayPath(dir), err)
	}
	for _, e := range t {
		p := joinPath(dir, e.Name)
		printEntry(out, e, p)
		if recursive && e.Mode.IsDir() {
			if err := listTree(ctx, s, b, out, e.Hash, p, true, depth+1); err != nil {
				return err
			}
		}
	}
	return nil
}

func printEntry(out io.Writer, e casstore.Entry, p string) {
	fmt.Fprintf(out, "%s %s %s\n", e.Mode, e.Hash, quotePath(p))
}

// lookupPath finds the entry at p inside root. An empty p (or "/", ".") names the
// root itself, as a directory entry. It returns the entry and p in canonical form
// ('/'-separated, no leading or trailing slash).
func lookupPath(s *casstore.Store, root casstore.Hash, p string) (casstore.Entry, string, error) {
	cur := casstore.Entry{Mode: casstore.ModeDir, Hash: root}
	clean := strings.Trim(p, "/")
	if clean == "" || clean == "." {
		return cur, "", nil
	}
	parts := strings.Split(clean, "/")
	for _, name := range parts {
		if err := casstore.CheckName(name); err != nil {
			return cur, "", fmt.Errorf("path %q: %w: %w", p, err, errdefs.ErrInvalidArgument)
		}
	}
	for i, name := range parts {
		here := strings.Join(parts[:i], "/")
		if !cur.Mode.IsDir() {
			return cur, "", fmt.Errorf("path %q: %s is not a directory: %w", p, here, errdefs.ErrNotFound)
		}
		t, err := s.ReadTree(cur.Hash)
		if err != nil {
			return cur, "", fmt.Errorf("read tree %s at %s: %w", cur.Hash, displayPath(here), err)
		}
		e, ok := t.Lookup(name)
		if !ok {
			return cur, "", fmt.Errorf("path %q not found in root %s: %w", p, root.Short(), errdefs.ErrNotFound)
		}
		cur = e
	}
	return cur, clean, nil
}

func joinPath(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

func displayPath(p string) string {
	if p == "" {
		return "the root"
	}
	return strconv.Quote(p)
}

// quotePath prints a tree path on one line of output. Ordinary paths (spaces
// included) are printed as they are; a path holding a control character, '"' or '\'
// is printed as a quoted Go string, so a name with a newline cannot forge a line.
func quotePath(p string) string {
	for _, r := range p {
		if r < 0x20 || r == 0x7f || r == '"' || r == '\\' || r == utf8.RuneError {
			return strconv.Quote(p)
		}
	}
	return p
}

// Command stamp prints the wall-clock time, in nanoseconds, at which it started
// running: the "first instruction" of a workload in the warm-pool benchmark.
package main

import (
	"fmt"
	"os"
	"time"
)

func main() {
	now := time.Now().UnixNano()
	fmt.Fprintln(os.Stdout, now)
}

// Command postsafety prints scenario (d) of the benchmarks as a markdown
// table: for each contender and each failure of a POST's first attempt,
// whether the POST was retried, with or without an Idempotency-Key, whether
// the key stayed the same and whether the body was rewound.
//
//	go run ./cmd/postsafety
package main

import (
	"fmt"
	"os"

	"github.com/saferetry/saferetry/bench"
)

func main() {
	table, err := bench.POSTSafetyTable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "postsafety:", err)
		os.Exit(1)
	}
	fmt.Print(table)
}

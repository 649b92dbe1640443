// rulecheck reads a Prometheus rule file (`groups: [...]`, the spec of a PrometheusRule) on
// stdin and checks it as Prometheus loads one (`promtool check rules` does the same): every
// expression parses as PromQL, durations, label names and annotation templates are valid.
// It prints one problem per line and exits 1 if there is any.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/prometheus/common/model"
	"github.com/prometheus/common/promslog"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

func main() {
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	_, errs := rulefmt.Parse(data, false, model.UTF8Validation, parser.NewParser(parser.Options{}), promslog.NewNopLogger())
	for _, e := range errs {
		fmt.Println(e)
	}
	if len(errs) > 0 {
		os.Exit(1)
	}
}

// otelcol-infermesh: a real OpenTelemetry Collector with only what the tracing e2e test needs,
// built from the collector's own Go modules at one release (go.mod pins the v0.161.0 release set,
// core v1.67.0, contrib v0.161.0: the newest at which the contrib fileexporter builds here).
//
//	otelcol-infermesh --config FILE.yaml
//
// Components: the OTLP receiver (gRPC and HTTP) and the contrib file exporter (one JSON line of
// OTLP per export batch). It is what `ocb` (the collector builder) would generate for that list,
// written by hand so the build needs only the Go module proxy. docs/tracing.md.
package main

import (
	"fmt"
	"os"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/confmap/provider/yamlprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

// Version is the collector release the modules are pinned at (go.mod).
const Version = "0.161.0"

func components() (otelcol.Factories, error) {
	var err error
	f := otelcol.Factories{Telemetry: otelconftelemetry.NewFactory()}
	if f.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory()); err != nil {
		return f, err
	}
	if f.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](fileexporter.NewFactory()); err != nil {
		return f, err
	}
	f.ReceiverModules = map[component.Type]string{
		otlpreceiver.NewFactory().Type(): "go.opentelemetry.io/collector/receiver/otlpreceiver v" + Version,
	}
	f.ExporterModules = map[component.Type]string{
		fileexporter.NewFactory().Type(): "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter v" + Version,
	}
	return f, nil
}

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{Command: "otelcol-infermesh", Description: "OpenTelemetry Collector for infermesh's tracing e2e test", Version: Version},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{envprovider.NewFactory(), fileprovider.NewFactory(), yamlprovider.NewFactory()},
				DefaultScheme:     "env", // ${VAR} in the config, as the builder's collectors read it
			},
		},
	}
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "otelcol-infermesh:", err)
		os.Exit(1)
	}
}

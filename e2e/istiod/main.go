// istiod-harness: Istio's own discovery server (pilot), configured from a directory of rendered
// Kubernetes YAML, serving ADS in plaintext on a loopback port, with no Kubernetes API server.
//
// It is the in-process server Istio's own tests use (pilot/test/xds.NewFakeDiscoveryServer: the
// real config store, PushContext, generators and ADS; a fake Kubernetes client with no objects).
// `pilot-discovery discovery --registries= --configDir=DIR` would be the obvious tool, but at the
// pinned commit it panics at start (docs/kubernetes.md, "Proven with istiod").
//
//	istiod-harness --config DIR --xds 127.0.0.1:0 [--debug 127.0.0.1:0] [--mesh MESHCONFIG.yaml]
//
// Prints "xds ADDR" (and "debug ADDR") on stdout once pushes are ready; stops on SIGTERM/SIGINT.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"google.golang.org/protobuf/types/known/wrapperspb"

	meshconfig "istio.io/api/mesh/v1alpha1"
	"istio.io/istio/pilot/pkg/config/kube/crd"
	"istio.io/istio/pilot/pkg/features"
	"istio.io/istio/pilot/test/xds"
	"istio.io/istio/pkg/config/mesh"
	"istio.io/istio/pkg/log"
)

// runner stands in for *testing.T (the harness takes a test.Failer): a failure ends the process.
type runner struct{ cleanups []func() }

func (r *runner) Fail()                             { r.Fatal("failed") }
func (r *runner) FailNow()                          { r.Fatal("failed") }
func (r *runner) Fatal(args ...any)                 { r.exit(fmt.Sprint(args...)) }
func (r *runner) Fatalf(format string, args ...any) { r.exit(fmt.Sprintf(format, args...)) }
func (r *runner) Skip(args ...any)                  { r.exit("skip: " + fmt.Sprint(args...)) }
func (r *runner) Log(args ...any)                   { fmt.Fprintln(os.Stderr, args...) }
func (r *runner) Logf(format string, args ...any)   { fmt.Fprintf(os.Stderr, format+"\n", args...) }
func (r *runner) Helper()                           {}
func (r *runner) Cleanup(f func())                  { r.cleanups = append(r.cleanups, f) }
func (r *runner) TempDir() string {
	d, err := os.MkdirTemp("", "istiod-harness")
	if err != nil {
		r.Fatal(err)
	}
	r.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

func (r *runner) stop() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
	r.cleanups = nil
}

func (r *runner) exit(msg string) {
	fmt.Fprintln(os.Stderr, "istiod-harness:", msg)
	r.stop()
	os.Exit(1)
}

// readConfigs parses every *.yaml / *.yml file of dir with Istio's own parser and validation; the
// objects istiod does not read (Deployments, Services, ConfigMaps…) are listed and skipped.
func readConfigs(r *runner, dir string) string {
	var files []string
	for _, pat := range []string{"*.yaml", "*.yml"} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		files = append(files, m...)
	}
	sort.Strings(files)
	if len(files) == 0 {
		r.Fatalf("no *.yaml files in %s", dir)
	}
	var docs []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			r.Fatal(err)
		}
		docs = append(docs, string(b))
	}
	text := strings.Join(docs, "\n---\n")
	configs, others, err := crd.ParseInputs(text)
	if err != nil {
		r.Fatalf("config in %s: %v", dir, err)
	}
	for _, c := range configs {
		fmt.Fprintf(os.Stderr, "istiod-harness: config %s %s/%s\n", c.GroupVersionKind.Kind, c.Namespace, c.Name)
	}
	for _, o := range others {
		fmt.Fprintf(os.Stderr, "istiod-harness: not for istiod: %s %s/%s\n", o.Kind, o.Namespace, o.Name)
	}
	return text
}

// meshConfig: Istio's defaults, less what needs Istio's own Envoy build or its agent
// (auto mTLS wants the agent's certificates; default telemetry providers add Istio-only filters),
// then the fields of the optional MeshConfig YAML file (as istiod's `meshConfig` install values:
// extensionProviders, ...) over them.
func meshConfig(r *runner, file string) *meshconfig.MeshConfig {
	m := mesh.DefaultMeshConfig()
	m.EnableAutoMtls = wrapperspb.Bool(false)
	m.DefaultProviders = &meshconfig.MeshConfig_DefaultProviders{}
	if file == "" {
		return m
	}
	b, err := os.ReadFile(file)
	if err != nil {
		r.Fatal(err)
	}
	applied, err := mesh.ApplyMeshConfig(string(b), m)
	if err != nil {
		r.Fatalf("mesh config %s: %v", file, err)
	}
	return applied
}

func main() {
	dir := flag.String("config", "", "directory of rendered YAML (Istio resources; other kinds are skipped)")
	xdsAddr := flag.String("xds", "127.0.0.1:15010", "plaintext ADS listen address")
	debugAddr := flag.String("debug", "", "optional: listen address of istiod's /debug endpoints")
	meshFile := flag.String("mesh", "", "optional: MeshConfig YAML over the harness's defaults (extensionProviders, ...)")
	flag.Parse()
	r := &runner{}
	// Istio logs to stdout by default; stdout carries only the ready lines here.
	logOpts := log.DefaultOptions()
	logOpts.OutputPaths = []string{"stderr"}
	if err := log.Configure(logOpts); err != nil {
		r.Fatal(err)
	}
	if *dir == "" {
		r.Fatal("--config DIR is required")
	}
	// Filters only Istio's Envoy build has (upstream Envoy rejects a config that names them).
	features.ALPNFilter = false
	features.MetadataExchange = false

	configs := readConfigs(r, *dir)
	xdsListener, err := net.Listen("tcp", *xdsAddr)
	if err != nil {
		r.Fatal(err)
	}
	server := xds.NewFakeDiscoveryServer(r, xds.FakeOptions{
		ConfigString:    configs,
		MeshConfig:      meshConfig(r, *meshFile),
		ListenerBuilder: func() (net.Listener, error) { return xdsListener, nil },
	})
	fmt.Printf("xds %s\n", xdsListener.Addr())
	if *debugAddr != "" {
		debugListener, err := net.Listen("tcp", *debugAddr)
		if err != nil {
			r.Fatal(err)
		}
		go func() { _ = http.Serve(debugListener, server.DiscoveryDebug) }()
		fmt.Printf("debug %s\n", debugListener.Addr())
	}
	_ = os.Stdout.Sync()

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	r.stop()
}

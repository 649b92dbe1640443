#!/usr/bin/env bash
# Tools the chart tests need, from the Go module proxy only (no release downloads):
#   - Helm, built with `go install helm.sh/helm/v3/cmd/helm@VERSION`;
#   - the schemas every rendered object is validated against: Kubernetes' OpenAPI v3 spec
#     (module k8s.io/kubernetes, api/openapi-spec/v3), Istio's CRDs (module istio.io/api,
#     kubernetes/customresourcedefinitions.gen.yaml) and the ServiceMonitor / PrometheusRule
#     CRDs (module github.com/prometheus-operator/prometheus-operator, example/prometheus-operator-crd);
#   - charts/tests/rulecheck, which checks the chart's alert rules as Prometheus loads a rule file
#     (the `promtool check rules` parser, github.com/prometheus/prometheus/model/rulefmt).
#
# Idempotent: everything lands in $INFERMESH_HOME (default ~/.cache/infermesh) under names that
# carry the versions (Helm's: its version and a digest of its build flags, so a binary built
# with other flags is replaced), so a second run only checks that the files are there.
#
#   scripts/setup-chart-tools.sh     install what is missing; prints HELM=, SCHEMAS=, RULECHECK= last
set -euo pipefail

HELM_VERSION=v3.22.0
K8S_VERSION=v1.34.4
ISTIO_API_VERSION=v1.32.0
# The newest version of the operator's root module that the Go module proxy serves.
PROM_OPERATOR_VERSION=v0.85.0

HOME_DIR="${INFERMESH_HOME:-$HOME/.cache/infermesh}"
RULECHECK_SRC="$(cd "$(dirname "$0")/../charts/tests/rulecheck" && pwd)"
RULECHECK="$HOME_DIR/bin/rulecheck-$(cat "$RULECHECK_SRC"/go.mod "$RULECHECK_SRC"/go.sum "$RULECHECK_SRC"/main.go | sha256sum | cut -c1-12)"
SCHEMAS="$HOME_DIR/chart-schemas/k8s-$K8S_VERSION-istio-$ISTIO_API_VERSION-prom-$PROM_OPERATOR_VERSION"
say() { echo "setup-chart-tools: $*" >&2; }

command -v go >/dev/null || { say "Go is required (it builds Helm and fetches the schema modules)"; exit 1; }
# -mod=mod: `go mod download` outside a module; GOTOOLCHAIN=local: never fetch another Go.
export GOFLAGS=-mod=mod GOTOOLCHAIN=local

# Prints the directory of a downloaded module.
module_dir() {
  local json
  json="$(go mod download -json "$1")" || { say "cannot download $1: $json"; exit 1; }
  printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p'
}

# Helm's own release flags (its Makefile): version, commit and tree state, and the Kubernetes
# version it assumes without --kube-version (the major.minor of its k8s.io/client-go, plus one
# on the major). Without the last two `helm template` assumes v1.20 and fails kubeVersion >= 1.30.
helm_json="$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION")" || { say "cannot download Helm $HELM_VERSION: $helm_json"; exit 1; }
helm_dir="$(printf '%s\n' "$helm_json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
helm_commit="$(printf '%s\n' "$helm_json" | sed -n 's/^[[:space:]]*"Hash": "\([0-9a-f]*\)",\{0,1\}$/\1/p')"
client_go="$(sed -n 's/^[[:space:]]*k8s.io\/client-go v\([0-9]*\)\.\([0-9]*\)\..*/\1 \2/p' "$helm_dir/go.mod")"
# The commit comes from the module's origin, which some module proxies leave out of the .info: it
# only labels `helm version`, so the build goes on without it; the client-go version is required.
[ -n "$client_go" ] || { say "cannot read Helm's client-go version from its go.mod"; exit 1; }
read -r cg_major cg_minor <<<"$client_go"
k8s_major=$((cg_major + 1)) k8s_minor=$cg_minor
HELM_LDFLAGS="-w -s -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
[ -z "$helm_commit" ] || HELM_LDFLAGS+=" -X helm.sh/helm/v3/internal/version.gitCommit=$helm_commit"
HELM_LDFLAGS+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in pkg/lint/rules pkg/chartutil; do
  HELM_LDFLAGS+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=$k8s_major -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$k8s_minor"
done
HELM="$HOME_DIR/bin/helm-$HELM_VERSION-$(printf '%s' "$HELM_LDFLAGS" | sha256sum | cut -c1-12)"

if [ ! -x "$HELM" ]; then
  t0=$SECONDS
  say "building Helm $HELM_VERSION (Kubernetes v$k8s_major.$k8s_minor by default) from the Go module proxy (a few minutes on 2 cores)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  # -trimpath as Helm's Makefile builds it.
  GOBIN="$tmp" go install -trimpath -ldflags "$HELM_LDFLAGS" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mkdir -p "$HOME_DIR/bin"
  mv "$tmp/helm" "$HELM"
  # Older builds of any Helm version (other flags, other versions) are never used again.
  find "$HOME_DIR/bin" -maxdepth 1 -name 'helm-v*' ! -path "$HELM" -delete
  say "Helm ready in $((SECONDS - t0))s"
fi

if [ ! -f "$SCHEMAS/.complete" ]; then
  t0=$SECONDS
  say "fetching the Kubernetes, Istio and prometheus-operator schemas into $SCHEMAS"
  rm -rf "$SCHEMAS"
  mkdir -p "$SCHEMAS/kubernetes" "$SCHEMAS/crds"
  k8s="$(module_dir "k8s.io/kubernetes@$K8S_VERSION")"
  istio="$(module_dir "istio.io/api@$ISTIO_API_VERSION")"
  prom="$(module_dir "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VERSION")"
  cp "$k8s"/api/openapi-spec/v3/*.json "$SCHEMAS/kubernetes/"
  cp "$istio/kubernetes/customresourcedefinitions.gen.yaml" "$SCHEMAS/crds/istio.yaml"
  for kind in servicemonitors prometheusrules; do
    cp "$prom/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$SCHEMAS/crds/"
  done
  # The module cache keeps its files read-only; the copies need not be.
  chmod -R u+w "$SCHEMAS"
  printf 'kubernetes %s\nistio.io/api %s\nprometheus-operator %s\n' \
    "$K8S_VERSION" "$ISTIO_API_VERSION" "$PROM_OPERATOR_VERSION" > "$SCHEMAS/VERSIONS"
  touch "$SCHEMAS/.complete"
  say "schemas ready in $((SECONDS - t0))s"
fi

if [ ! -x "$RULECHECK" ]; then
  t0=$SECONDS
  say "building rulecheck (Prometheus' rule-file parser)"
  mkdir -p "$HOME_DIR/bin"
  # -mod=readonly: the committed go.sum decides the versions; the build changes nothing there.
  # -buildvcs=false: no git stamp (the binary is keyed by its sources above).
  (cd "$RULECHECK_SRC" && GOFLAGS="-mod=readonly -buildvcs=false" go build -o "$RULECHECK.tmp" .)
  mv "$RULECHECK.tmp" "$RULECHECK"
  say "rulecheck ready in $((SECONDS - t0))s"
fi

echo "HELM=$HELM"
echo "SCHEMAS=$SCHEMAS"
echo "RULECHECK=$RULECHECK"

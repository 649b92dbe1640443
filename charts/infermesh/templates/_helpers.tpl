{{/*
Names, labels and what every template derives from the policy. The templates are the one layout
of the Istio objects: `infermesh policy render POLICY istio` (mesh-config/meshconfig/istio.py)
renders them too (docs/istio.md).
*/}}

{{/* The policy, as YAML: .Values.policy, or the bundled files/default-policy.yaml when that is
empty (a default under .Values.policy would be merged with the user's policy, map by map). */}}
{{- define "infermesh.policy" -}}
{{- if .Values.policy -}}
{{- toYaml .Values.policy -}}
{{- else -}}
{{- .Files.Get "files/default-policy.yaml" | fromYaml | toYaml -}}
{{- end -}}
{{- end -}}

{{/* What the chart takes from the policy model, as JSON: .Values.generated (written with the
policy by `infermesh policy render POLICY helm-values`), or files/default-generated.json for the
bundled policy. Nothing here decides: the model did (mesh-config/meshconfig/istio_parts.py).
Refused, naming the fix, when missing or written for another policy (a policy edited after).
Every template reads it through this, so whichever renders first reports it (_validate.tpl). */}}
{{- define "infermesh.generated" -}}
{{- $g := .Values.generated -}}
{{- if not .Values.policy -}}
{{- $g = .Files.Get "files/default-generated.json" | fromJson -}}
{{- else if not $g -}}
{{- fail "generated: missing: the chart takes routes, pools and the filter from the policy model; write policy and generated together with `infermesh policy render POLICY helm-values > values.json` and install with -f values.json (docs/kubernetes.md)" -}}
{{- end -}}
{{- $digest := .Values.policy | default (.Files.Get "files/default-policy.yaml" | fromYaml) | toJson | sha256sum -}}
{{- if ne $g.policySha256 $digest -}}
{{- fail (printf "generated.policySha256: written for another policy (%s, this policy is %s): regenerate with `infermesh policy render POLICY helm-values` after every policy change" ($g.policySha256 | default "none") $digest) -}}
{{- end -}}
{{- include "infermesh.validate" (dict "root" . "generated" $g) -}}
{{- toJson $g -}}
{{- end -}}

{{/* What an Istio object takes from the release's options, decided by the policy model
(istio_parts.ISTIO_DECISIONS, written by `python -m infermesh.meshconfig.istio_parts`): the
cluster names, the patch context of filter.attachTo, the failure policy of filter.failStrategy,
the default selector, the thresholds from a connectionPool, the code of a file:// module. */}}
{{- define "infermesh.istioDecisions" -}}
{{- .Files.Get "files/istio-decisions.json" -}}
{{- end -}}

{{/* An Istio cluster name: (dict "pattern" (outboundCluster | spillCluster) "port" P "host" FQDN). */}}
{{- define "infermesh.clusterName" -}}
{{- .pattern | replace "{port}" (toString (int .port)) | replace "{host}" .host -}}
{{- end -}}

{{- define "infermesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "infermesh.poolName" -}}
{{- printf "%s-%s" (include "infermesh.fullname" .root) .pool -}}
{{- end -}}

{{- define "infermesh.fqdn" -}}
{{- printf "%s.%s.svc.%s" .name .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "infermesh.labels" -}}
app.kubernetes.io/name: infermesh
app.kubernetes.io/instance: {{ include "infermesh.fullname" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The labels of sidecar pods: all pools (no .pool) or one. */}}
{{- define "infermesh.selectorLabels" -}}
app.kubernetes.io/name: infermesh
app.kubernetes.io/instance: {{ include "infermesh.fullname" .root }}
app.kubernetes.io/component: sidecar
{{- if .pool }}
infermesh.io/pool: {{ .pool }}
{{- end }}
{{- end -}}

{{/* The settings of one pool's pods: poolDefaults overlaid with pools.<name>. */}}
{{- define "infermesh.poolSettings" -}}
{{- $over := get .root.Values.pools .pool | default dict -}}
{{- toYaml (merge (deepCopy $over) (deepCopy .root.Values.poolDefaults)) -}}
{{- end -}}

{{/* The VirtualService's routes: the model's route parts, each with its pool's Service and port,
then the edge's JSON 404 for every other path. */}}
{{- define "infermesh.httpRoutes" -}}
{{- $root := . -}}
{{- $out := list -}}
{{- $g := include "infermesh.generated" . | fromJson -}}
{{- range $r := $g.routes -}}
{{- $host := include "infermesh.fqdn" (dict "root" $root "name" (include "infermesh.poolName" (dict "root" $root "pool" $r.pool))) -}}
{{- $port := int (ternary $root.Values.ports.grpc $root.Values.ports.http $r.grpc) -}}
{{- $dest := dict "destination" (dict "host" $host "port" (dict "number" $port)) -}}
{{- $out = append $out (merge (dict "route" (list $dest)) $r.http) -}}
{{- end -}}
{{- $out = append $out $g.edge.notFound -}}
{{- toYaml $out -}}
{{- end -}}

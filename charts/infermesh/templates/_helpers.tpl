{{/*
Names, labels and what every template derives from the policy. Names and labels follow
mesh-config/meshconfig/istio.py (tests compare the two renderings of the same policy).
*/}}

{{/* The policy, as YAML: .Values.policy, or the bundled files/default-policy.yaml when that is
empty (a default under .Values.policy would be merged with the user's policy, map by map). */}}
{{- define "infermesh.rawPolicy" -}}
{{- if .Values.policy -}}
{{- toYaml .Values.policy -}}
{{- else -}}
{{- .Files.Get "files/default-policy.yaml" | fromYaml | toYaml -}}
{{- end -}}
{{- end -}}

{{/* Every template reads the policy through this, so whichever renders first reports a bad
cross reference by its field (_validate.tpl) instead of failing somewhere inside. */}}
{{- define "infermesh.policy" -}}
{{- include "infermesh.validate" . -}}
{{- include "infermesh.rawPolicy" . -}}
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

{{- define "infermesh.defaultPool" -}}
{{- $p := include "infermesh.policy" . | fromYaml -}}
{{- (get $p.classes $p.default_class).pool -}}
{{- end -}}

{{/* "true" when some rule matches on the body: the filter then has to be able to pause. */}}
{{- define "infermesh.needsBody" -}}
{{- $body := false -}}
{{- range (include "infermesh.policy" . | fromYaml).rules -}}
{{- if and .match (hasKey .match "body") -}}{{- $body = true -}}{{- end -}}
{{- end -}}
{{- $body -}}
{{- end -}}

{{/* The filter's JSON config: what Policy.filter_config() generates (mesh-config/meshconfig/policy.py). */}}
{{- define "infermesh.filterConfig" -}}
{{- $p := include "infermesh.policy" . | fromYaml -}}
{{- $f := $p.filter | default dict -}}
{{- $classes := dict -}}
{{- range $name, $c := $p.classes -}}
{{- $cls := dict "pool" $c.pool -}}
{{- if $c.objective -}}{{- $_ := set $cls "objective" $c.objective -}}{{- end -}}
{{- $_ := set $classes $name $cls -}}
{{- end -}}
{{- $cfg := dict "version" 1 "default_class" $p.default_class "classes" $classes "rules" ($p.rules | default list) -}}
{{- $_ := set $cfg "body" (dict "max_bytes" (hasKey $f "body_max_bytes" | ternary $f.body_max_bytes 262144)) -}}
{{- $_ := set $cfg "emit_objective_header" ($f.emit_objective_header | default false) -}}
{{- if or $f.trusted_cidrs $f.trusted_principals -}}
{{- $_ := set $cfg "trusted_sources" (dict "cidrs" ($f.trusted_cidrs | default list) "principals" ($f.trusted_principals | default list)) -}}
{{- end -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* The settings of one pool's pods: poolDefaults overlaid with pools.<name>. */}}
{{- define "infermesh.poolSettings" -}}
{{- $over := get .root.Values.pools .pool | default dict -}}
{{- toYaml (merge (deepCopy $over) (deepCopy .root.Values.poolDefaults)) -}}
{{- end -}}

{{/* The VirtualService routes: per pool on the pool header, then the default, each with its
gRPC twin first (istio.py http_routes; envoy_bootstrap's routes in plain Envoy). Retries only
what never reached a sidecar: a 503 / UNAVAILABLE is a pool shedding or draining on purpose. */}}
{{- define "infermesh.httpRoutes" -}}
{{- $root := . -}}
{{- $targets := list -}}
{{- range $pool, $_ := (include "infermesh.policy" . | fromYaml).pools -}}
{{- $targets = append $targets (list (printf "class-pool-%s" $pool) $pool true) -}}
{{- end -}}
{{- $targets = append $targets (list "default-pool" (include "infermesh.defaultPool" .) false) -}}
{{- range $t := $targets -}}
{{- $name := index $t 0 -}}
{{- $pool := index $t 1 -}}
{{- $byHeader := index $t 2 -}}
{{- $host := include "infermesh.fqdn" (dict "root" $root "name" (include "infermesh.poolName" (dict "root" $root "pool" $pool))) -}}
{{- range $grpc := list true false }}
- name: {{ $name }}{{ if $grpc }}-grpc{{ end }}
  {{- if or $byHeader $grpc }}
  match:
    - headers:
        {{- if $grpc }}
        content-type:
          prefix: application/grpc
        {{- end }}
        {{- if $byHeader }}
        x-infermesh-pool:
          exact: {{ $pool }}
        {{- end }}
  {{- end }}
  route:
    - destination:
        host: {{ $host }}
        port:
          number: {{ int (ternary $root.Values.ports.grpc $root.Values.ports.http $grpc) }}
  timeout: 0s
  retries:
    attempts: 2
    retryOn: connect-failure,refused-stream,reset
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
What only the chart can check: its own values against the policy's pools, the Service names the
release gives them, and the required filter settings. The policy itself was checked by the
policy model when its `generated` values were written (`infermesh policy render … helm-values`
refuses a policy that `infermesh policy check` refuses). Run by "infermesh.generated"
(_helpers.tpl), so by every template. Takes (dict "root" $ "generated" $g).
*/}}
{{- define "infermesh.validate" -}}
{{- $root := .root -}}
{{- $pools := keys .generated.pools | sortAlpha -}}
{{- range $name := $pools -}}
{{- $svc := include "infermesh.poolName" (dict "root" $root "pool" $name) -}}
{{- if gt (len $svc) 63 -}}
{{- fail (printf "policy.pools.%s: the Service name %q is longer than 63 characters" $name $svc) -}}
{{- end -}}
{{- end -}}
{{- range $name, $_ := $root.Values.pools -}}
{{- if not (has $name $pools) -}}
{{- fail (printf "pools.%s: not a pool of the policy %v" $name $pools) -}}
{{- end -}}
{{- end -}}
{{- if not .generated.edge -}}
{{- fail "generated.edge: missing: these values were written before the edge served only the inference API; regenerate with `infermesh policy render POLICY helm-values`" -}}
{{- end -}}
{{- if not $root.Values.filter.url -}}
{{- fail "filter.url: required: where proxies fetch the Wasm filter (oci://…, https://…, file://…); see docs/kubernetes.md" -}}
{{- end -}}
{{- if and .generated.tracing (not $root.Values.tracing.istioProvider) -}}
{{- fail "tracing.istioProvider: required with the policy's tracing on: the name of the `opentelemetry` extensionProvider in Istio's MeshConfig that points at the policy's collector (docs/tracing.md, \"Istio\")" -}}
{{- end -}}
{{- if not $root.Values.filter.sha256 -}}
{{- fail "filter.sha256: required: the SHA-256 of the Wasm module (the image digest for oci://); see docs/kubernetes.md" -}}
{{- end -}}
{{- end -}}

{{/*
Cross references of the policy that a JSON schema cannot express, checked as
`infermesh policy check` checks them (mesh-config/meshconfig/policy.py), and the required
filter settings. Run by "infermesh.policy" (_helpers.tpl), so by every template.
*/}}
{{- define "infermesh.validate" -}}
{{- $p := include "infermesh.rawPolicy" . | fromYaml -}}
{{- $pools := keys $p.pools | sortAlpha -}}
{{- $classes := keys $p.classes | sortAlpha -}}
{{- if not (hasKey $p.classes $p.default_class) -}}
{{- fail (printf "policy.default_class: %q is not one of the classes %v" $p.default_class $classes) -}}
{{- end -}}
{{- range $name, $c := $p.classes -}}
{{- if not (has $c.pool $pools) -}}
{{- fail (printf "policy.classes.%s.pool: %q is not one of the pools %v" $name $c.pool $pools) -}}
{{- end -}}
{{- end -}}
{{- $seen := list -}}
{{- range $i, $r := $p.rules -}}
{{- if has $r.name $seen -}}
{{- fail (printf "policy.rules.%d.name: duplicate rule name %q" $i $r.name) -}}
{{- end -}}
{{- $seen = append $seen $r.name -}}
{{- if not (has (index $r "class") $classes) -}}
{{- fail (printf "policy.rules.%d.class: %q is not one of the classes %v" $i (index $r "class") $classes) -}}
{{- end -}}
{{- end -}}
{{- range $name, $pool := $p.pools -}}
{{- with $pool.when_degraded -}}
{{- if and .spill_to (or (not (has .spill_to $pools)) (eq .spill_to $name)) -}}
{{- fail (printf "policy.pools.%s.when_degraded.spill_to: %q must be another of the pools %v" $name .spill_to $pools) -}}
{{- end -}}
{{- range .shed_classes -}}
{{- if not (has . $classes) -}}
{{- fail (printf "policy.pools.%s.when_degraded.shed_classes: %q is not one of the classes %v" $name . $classes) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $bname, $b := $pool.breakers -}}
{{- if gt $b.recover_below $b.trip_above -}}
{{- fail (printf "policy.pools.%s.breakers.%s.recover_below: %v must not be above trip_above (%v)" $name $bname $b.recover_below $b.trip_above) -}}
{{- end -}}
{{- end -}}
{{- $svc := include "infermesh.poolName" (dict "root" $ "pool" $name) -}}
{{- if gt (len $svc) 63 -}}
{{- fail (printf "policy.pools.%s: the Service name %q is longer than 63 characters" $name $svc) -}}
{{- end -}}
{{- end -}}
{{- range $name, $_ := .Values.pools -}}
{{- if not (has $name $pools) -}}
{{- fail (printf "pools.%s: not a pool of the policy %v" $name $pools) -}}
{{- end -}}
{{- end -}}
{{- if not .Values.filter.url -}}
{{- fail "filter.url: required: where proxies fetch the Wasm filter (oci://…, https://…, file://…); see docs/kubernetes.md" -}}
{{- end -}}
{{- if not .Values.filter.sha256 -}}
{{- fail "filter.sha256: required: the SHA-256 of the Wasm module (the image digest for oci://); see docs/kubernetes.md" -}}
{{- end -}}
{{- end -}}

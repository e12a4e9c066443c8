{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "prefill"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The headless Service of a worker role, and the name the gateway resolves for it. */}}
{{- define "tandem.headlessName" -}}
{{- printf "%s-%s-headless" (include "tandem.fullname" .root) .role | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.workerTarget" -}}
{{- $values := index .root.Values .role -}}
{{- printf "dns:///%s.%s.svc.%s:%v" (include "tandem.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain $values.port -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The gateway's gRPC API port, 0 while the API is off. 30051, the gateway's own default, when the value is
missing altogether (`helm upgrade --reuse-values` from a release made before it existed). The gateway
refuses to start with both APIs on one port, so the chart refuses to render that. */}}
{{- define "tandem.gatewayGrpcPort" -}}
{{- $g := .Values.gateway -}}
{{- $port := ternary $g.grpcPort 30051 (hasKey $g "grpcPort") | int -}}
{{- if eq $port (int $g.port) -}}
{{- fail (printf "gateway.grpcPort (%d) must differ from gateway.port, or be 0 to turn the gRPC API off" $port) -}}
{{- end -}}
{{- $port -}}
{{- end -}}

{{/* A pod's --drain-timeout (30, the servers' own default, when the value is missing: `helm upgrade
--reuse-values` from an older release), refused unless the preStop sleep and the drain fit in the grace
period: Kubernetes kills the pod when the grace period ends, whatever is still in flight. */}}
{{- define "tandem.drainTimeout" -}}
{{- $drain := ternary .values.drainTimeoutSeconds 30 (hasKey .values "drainTimeoutSeconds") | int -}}
{{- if ge (add (int .values.preStopSleepSeconds) $drain) (int .values.terminationGracePeriodSeconds) -}}
{{- fail (printf "%s: preStopSleepSeconds (%d) + drainTimeoutSeconds (%d) must be less than terminationGracePeriodSeconds (%d)" .name (int .values.preStopSleepSeconds) $drain (int .values.terminationGracePeriodSeconds)) -}}
{{- end -}}
{{- $drain -}}
{{- end -}}

{{/* The model volume and its mount, when the model comes from a PVC (call only then). */}}
{{- define "tandem.modelVolumeMount" -}}
- name: model
  mountPath: /models
  readOnly: true
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end -}}

{{- define "tandem.modelVolume" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- end -}}

{{- define "tandem.configChecksum" -}}
{{- include (print .Template.BasePath "/configmap.yaml") . | sha256sum -}}
{{- end -}}

{{/* The internal token: the Secret that holds it, its key, where pods mount it, and the flag that
reads it. The values may be missing altogether (`helm upgrade --reuse-values` from a release made
before they existed), hence `default dict`. */}}
{{- define "tandem.internalTokenSecret" -}}
{{- default (printf "%s-internal-token" (include "tandem.fullname" .)) (default dict .Values.internalToken).existingSecret -}}
{{- end -}}

{{- define "tandem.internalTokenKey" -}}
{{- default "internal-token" (default dict .Values.internalToken).key -}}
{{- end -}}

{{- define "tandem.internalTokenDir" -}}/run/tandem-secrets{{- end -}}

{{- define "tandem.internalTokenArg" -}}
--internal-token-file={{ include "tandem.internalTokenDir" . }}/internal-token
{{- end -}}

{{- define "tandem.internalTokenVolumeMount" -}}
- name: internal-token
  mountPath: {{ include "tandem.internalTokenDir" . }}
  readOnly: true
{{- end -}}

{{/* 0440 and the pod's fsGroup: the token file is root's, readable by the tandem group only. */}}
{{- define "tandem.internalTokenVolume" -}}
- name: internal-token
  secret:
    secretName: {{ include "tandem.internalTokenSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ include "tandem.internalTokenKey" . }}
        path: internal-token
{{- end -}}

{{/* The KV grant secret: it keys the grants that let a prefill worker write a decode worker's pages.
Worker pods only: the gateway holds the internal token, so were it to hold this too it could sign
KV writes. Shaped as the internal token's helpers above. */}}
{{- define "tandem.kvGrantSecret" -}}
{{- default (printf "%s-kv-grant-secret" (include "tandem.fullname" .)) (default dict .Values.kvGrantSecret).existingSecret -}}
{{- end -}}

{{- define "tandem.kvGrantSecretKey" -}}
{{- default "kv-grant-secret" (default dict .Values.kvGrantSecret).key -}}
{{- end -}}

{{- define "tandem.kvGrantSecretDir" -}}/run/tandem-grant{{- end -}}

{{- define "tandem.kvGrantSecretArg" -}}
--kv-grant-secret-file={{ include "tandem.kvGrantSecretDir" . }}/kv-grant-secret
{{- end -}}

{{- define "tandem.kvGrantSecretVolumeMount" -}}
- name: kv-grant-secret
  mountPath: {{ include "tandem.kvGrantSecretDir" . }}
  readOnly: true
{{- end -}}

{{- define "tandem.kvGrantSecretVolume" -}}
- name: kv-grant-secret
  secret:
    secretName: {{ include "tandem.kvGrantSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ include "tandem.kvGrantSecretKey" . }}
        path: kv-grant-secret
{{- end -}}

{{/* "true" when the worker NetworkPolicies are rendered: networkPolicy.enabled, true when absent. */}}
{{- define "tandem.networkPolicyEnabled" -}}
{{- $policy := default dict .Values.networkPolicy -}}
{{- if ternary $policy.enabled true (hasKey $policy "enabled") }}true{{ end -}}
{{- end -}}

{{/* The KV page store (kvStore.*): "true" when it is rendered (off when the values predate it: `helm
upgrade --reuse-values`), its Service's address as the workers' --kv-store takes it, and its image,
each field image.worker's unless kvStore.image sets it. */}}
{{- define "tandem.kvStoreEnabled" -}}
{{- if (default dict .Values.kvStore).enabled }}true{{ end -}}
{{- end -}}

{{- define "tandem.kvStoreName" -}}
{{- printf "%s-kv-store" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.kvStoreAddress" -}}
{{- printf "%s.%s.svc.%s:%v" (include "tandem.kvStoreName" .) .Release.Namespace .Values.clusterDomain .Values.kvStore.port -}}
{{- end -}}

{{- define "tandem.kvStoreImage" -}}
{{- $own := default dict .Values.kvStore.image -}}
{{- $worker := .Values.image.worker -}}
{{- dict "repository" (default $worker.repository $own.repository) "tag" (default $worker.tag $own.tag) "pullPolicy" (default $worker.pullPolicy $own.pullPolicy) | toYaml -}}
{{- end -}}

{{/* The store's NetworkPolicy: where the worker ones are, unless the workers use the node's network (the
RDMA profile), whose traffic comes from node addresses that no pod selector matches. */}}
{{- define "tandem.kvStorePolicyEnabled" -}}
{{- $hostNetwork := and (eq .Values.kv.protocol "rdma") .Values.kv.rdma.hostNetwork -}}
{{- if and (include "tandem.kvStoreEnabled" .) (include "tandem.networkPolicyEnabled" .) (not $hostNetwork) }}true{{ end -}}
{{- end -}}

{{/* The components whose pods reach each other's Mooncake ports, as a flow list: the workers, and the KV
store when it is on (Mooncake's transfer engines connect both ways). */}}
{{- define "tandem.kvPeers" -}}
{{- if include "tandem.kvStoreEnabled" . }}[prefill, decode, kv-store]{{ else }}[prefill, decode]{{ end -}}
{{- end -}}

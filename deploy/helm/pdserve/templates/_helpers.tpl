{{/*
Names. Components (gateway, tokenizer, detokenizer, prefill, decode) are named <fullname>-<component>;
52 characters leave room for the StatefulSet pod suffix and controller-revision-hash label.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* (list $ "decode") -> "<fullname>-decode" */}}
{{- define "pdserve.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "pdserve.fullname" $root) (index . 1) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* (list $ "decode") -> the labels that select one component's pods */}}
{{- define "pdserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* (list $ "decode") -> common labels plus the component's selector labels */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "pdserve.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if eq .Values.image.variant "cuda" }}
{{- $tag = printf "%s-cuda" $tag }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the API key; empty when the API is open. */}}
{{- define "pdserve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.create }}
{{- printf "%s-api-key" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pdserve.cacheClaimName" -}}
{{- default (printf "%s-cache" (include "pdserve.fullname" .)) .Values.cache.pvc.existingClaim }}
{{- end }}

{{/*
Addresses the gateway dials. Schedulers are StatefulSet pods behind a headless Service, so each has a
stable DNS name: (list $ "decode") -> "<name>-0.<name>.<ns>.svc.<domain>:<port>,<name>-1...", one
per replica ("" for 0 replicas = colocated). Stateless roles are reached through their headless
Service's name, which resolves to the IP of every ready pod.
*/}}
{{- define "pdserve.podAddresses" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- $values := index $root.Values $component }}
{{- $name := include "pdserve.componentName" . }}
{{- $addresses := list }}
{{- range $i := until (int $values.replicas) }}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc.%s:%d" $name $i $name $root.Release.Namespace $root.Values.clusterDomain (int $values.port)) }}
{{- end }}
{{- join "," $addresses }}
{{- end }}

{{/*
(list $ "decode") -> the gateway's address flag for a scheduler role: its fixed pod list, or with
<role>.autoscaling the headless Service as dns:<name>:<port>, resolved again as pods come and go.
*/}}
{{- define "pdserve.workerAddresses" -}}
{{- $root := index . 0 }}
{{- $values := index $root.Values (index . 1) }}
{{- if and $values.autoscaling.enabled (gt (int $values.replicas) 0) }}
{{- printf "dns:%s.%s.svc.%s:%d" (include "pdserve.componentName" .) $root.Release.Namespace $root.Values.clusterDomain (int $values.port) }}
{{- else }}
{{- include "pdserve.podAddresses" . }}
{{- end }}
{{- end }}

{{- define "pdserve.serviceAddress" -}}
{{- $root := index . 0 }}
{{- $values := index $root.Values (index . 1) }}
{{- printf "%s.%s.svc.%s:%d" (include "pdserve.componentName" .) $root.Release.Namespace $root.Values.clusterDomain (int $values.port) }}
{{- end }}

{{/* The gRPC service each role registers; its readiness probe asks grpc.health.v1 for it. */}}
{{- define "pdserve.grpcServiceName" -}}
{{- get (dict "tokenizer" "pdserve.v1.Tokenizer" "detokenizer" "pdserve.v1.Detokenizer" "prefill" "pdserve.v1.PrefillScheduler" "decode" "pdserve.v1.DecodeScheduler") . }}
{{- end }}

{{/*
(list $ "decode") -> the pod's terminationGracePeriodSeconds: the role's own value, or (null) its
drainTimeoutSeconds plus a 15 s margin for what follows the drain (the aborts' flush, the servers'
stop). Roles without a drain (tokenizer, detokenizer) give their own value.
*/}}
{{- define "pdserve.terminationGrace" -}}
{{- $values := index (index . 0).Values (index . 1) -}}
{{- if kindIs "invalid" $values.terminationGracePeriodSeconds -}}
{{- add (int $values.drainTimeoutSeconds) 15 -}}
{{- else -}}
{{- int $values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end }}

{{/* Values that the schema cannot check on their own. */}}
{{- define "pdserve.validate" -}}
{{- $gpuRoles := list }}
{{- range $component := list "gateway" "tokenizer" "detokenizer" "prefill" "decode" }}
{{- if gt (int (index $.Values $component).gpus) 0 }}
{{- $gpuRoles = append $gpuRoles $component }}
{{- end }}
{{- end }}
{{- if and $gpuRoles (ne .Values.image.variant "cuda") }}
{{- fail (printf "%s request GPUs: set image.variant=cuda" (join ", " $gpuRoles)) }}
{{- end }}
{{- if and (not (has .Values.engine.quantization (list "none" "auto"))) (or (gt (int .Values.decode.gpus) 0) (gt (int .Values.prefill.gpus) 0)) }}
{{- fail (printf "engine.quantization=%s runs on CPU only: set decode.gpus and prefill.gpus to 0" .Values.engine.quantization) }}
{{- end }}
{{- if and (eq .Values.engine.attentionBackend "flashinfer") (eq (int .Values.decode.gpus) 0) }}
{{- fail "engine.attentionBackend=flashinfer runs on CUDA only: set decode.gpus (and prefill.gpus)" }}
{{- end }}
{{- if and (eq .Values.model.source.type "pvc") (not .Values.model.source.pvc.claimName) }}
{{- fail "model.source.type=pvc needs model.source.pvc.claimName" }}
{{- end }}
{{- if and (eq .Values.model.source.type "hostPath") (not .Values.model.source.hostPath.path) }}
{{- fail "model.source.type=hostPath needs model.source.hostPath.path" }}
{{- end }}
{{- if and (eq .Values.model.source.type "initContainer") (not .Values.model.source.initContainer.image) }}
{{- fail "model.source.type=initContainer needs model.source.initContainer.image" }}
{{- end }}
{{- range $component := list "gateway" "prefill" "decode" }}
{{- $values := index $.Values $component }}
{{- if lt (int (include "pdserve.terminationGrace" (list $ $component))) (add (int $values.drainTimeoutSeconds) 5) }}
{{- fail (printf "%s.terminationGracePeriodSeconds must be at least %s.drainTimeoutSeconds + 5 (Kubernetes kills the pod at the grace period, cutting its drain)" $component $component) }}
{{- end }}
{{- end }}
{{- range $component := list "prefill" "decode" }}
{{- $autoscaling := (index $.Values $component).autoscaling }}
{{- if $autoscaling.enabled }}
{{- if not $.Values.podMonitor.enabled }}
{{- fail (printf "%s.autoscaling reads the per-pod metrics from Prometheus: set podMonitor.enabled" $component) }}
{{- end }}
{{- if lt (int $autoscaling.maxReplicas) (int $autoscaling.minReplicas) }}
{{- fail (printf "%s.autoscaling.maxReplicas is below its minReplicas" $component) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.prefill.autoscaling.enabled (eq (int .Values.prefill.replicas) 0) }}
{{- fail "prefill.autoscaling needs prefill.replicas > 0 (0 prefill replicas is the colocated mode)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" }}
{{- end }}
{{- end }}

{{/* (list $ grpcPort) -> the port kubelet's gRPC probes use: with TLS the plaintext health port */}}
{{- define "pdserve.probePort" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.tls.enabled }}{{ int $root.Values.tls.healthPort }}{{ else }}{{ index . 1 }}{{ end }}
{{- end }}

{{/* (list $ port service) -> startup/liveness on the server's overall health, readiness on its service */}}
{{- define "pdserve.grpcProbes" -}}
{{- $root := index . 0 -}}
{{- $port := include "pdserve.probePort" (list $root (index . 1)) -}}
startupProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml $root.Values.probes.startup | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml $root.Values.probes.liveness | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ $port }}
    service: {{ index . 2 }}
  {{- toYaml $root.Values.probes.readiness | nindent 2 }}
{{- end }}

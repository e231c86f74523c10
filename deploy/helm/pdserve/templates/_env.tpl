{{/* The gateway's own flags (PDSERVE_<FLAG> env), including where every other role is. */}}
{{- define "pdserve.gatewayEnv" -}}
- name: PDSERVE_PORT
  value: {{ .Values.gateway.port | int | toString | quote }}
- name: PDSERVE_GRPC_PORT
  value: {{ .Values.gateway.grpcPort | int | toString | quote }}
- name: PDSERVE_INTERNAL_HOST
  value: 0.0.0.0
- name: PDSERVE_INTERNAL_GRPC_PORT
  value: {{ .Values.gateway.internalPort | int | toString | quote }}
# Detokenizers stream a request's text back to the replica that owns it: this pod's IP.
- name: PDSERVE_ADVERTISE_HOST
  value: $(POD_IP)
{{- if .Values.tls.enabled }}
{{- if .Values.tls.publicSecretName }}
- name: PDSERVE_PUBLIC_TLS_CERT
  value: /etc/pdserve/public-tls/tls.crt
- name: PDSERVE_PUBLIC_TLS_KEY
  value: /etc/pdserve/public-tls/tls.key
{{- end }}
{{- if .Values.tls.publicClientAuth }}
- name: PDSERVE_PUBLIC_CLIENT_CA
  value: /etc/pdserve/tls/ca.crt
{{- end }}
{{- end }}
- name: PDSERVE_DRAIN_TIMEOUT
  value: {{ .Values.gateway.drainTimeoutSeconds | int | toString | quote }}
- name: PDSERVE_ROUTER_POLICY
  value: {{ .Values.gateway.routerPolicy }}
{{- if gt (int .Values.gateway.workers) 1 }}
# Gateway processes sharing the public HTTP and gRPC ports (SO_REUSEPORT); worker i takes its
# outputs on its own internal port, internalPort + i.
- name: PDSERVE_WORKERS
  value: {{ .Values.gateway.workers | int | toString | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.gateway.maxPendingRequests) }}
- name: PDSERVE_MAX_PENDING_REQUESTS
  value: {{ .Values.gateway.maxPendingRequests | int64 | toString | quote }}
{{- end }}
{{- with .Values.model.servedModelName }}
- name: PDSERVE_SERVED_MODEL_NAME
  value: {{ . | quote }}
{{- end }}
# dns:/// names of headless Services: gRPC resolves every ready pod and round-robins calls over them.
- name: PDSERVE_TOKENIZER_ADDRESSES
  value: dns:///{{ include "pdserve.serviceAddress" (list . "tokenizer") }}
- name: PDSERVE_DETOKENIZER_ADDRESSES
  value: dns:///{{ include "pdserve.serviceAddress" (list . "detokenizer") }}
- name: PDSERVE_DECODE_ADDRESSES
  value: {{ include "pdserve.workerAddresses" (list . "decode") | quote }}
- name: PDSERVE_PREFILL_ADDRESSES
  value: {{ include "pdserve.workerAddresses" (list . "prefill") | quote }}
{{- with include "pdserve.apiKeySecretName" . }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKey.secretKey }}
{{- end }}
{{- end }}

{{/*
(list $ "decode") -> a scheduler's own flags; it advertises its stable pod DNS name. With no prefill
pods, decode runs colocated (prefills itself).
*/}}
{{- define "pdserve.schedulerEnv" -}}
{{- $root := index . 0 }}
{{- $values := index $root.Values (index . 1) -}}
- name: PDSERVE_PORT
  value: {{ $values.port | int | toString | quote }}
- name: PDSERVE_ADVERTISE_HOST
  value: {{ printf "$(POD_NAME).%s.%s.svc.%s" (include "pdserve.componentName" .) $root.Release.Namespace $root.Values.clusterDomain }}
- name: PDSERVE_WORKER_ID
  value: $(POD_NAME)
- name: PDSERVE_SCHEDULE_POLICY
  value: {{ $values.schedulePolicy }}
- name: PDSERVE_DRAIN_TIMEOUT
  value: {{ $values.drainTimeoutSeconds | int | toString | quote }}
{{- with $values.maxRunningRequests }}
- name: PDSERVE_MAX_RUNNING_REQUESTS
  value: {{ . | int64 | toString | quote }}
{{- end }}
{{- with $values.tpSize }}
# this role's TP size, over the engine ConfigMap's
- name: PDSERVE_TP_SIZE
  value: {{ . | int | toString | quote }}
{{- end }}
{{- if and (eq (index . 1) "decode") (eq (int $root.Values.prefill.replicas) 0) }}
- name: PDSERVE_COLOCATED
  value: "true"
{{- end }}
{{- end }}

{{/*
Gateway: alive while its gRPC server answers (with TLS: its plaintext health port); ready once /health
sees every role healthy.
*/}}
{{- define "pdserve.gatewayProbes" -}}
{{- $port := include "pdserve.probePort" (list . (int .Values.gateway.grpcPort)) }}
startupProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml .Values.probes.startup | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml .Values.probes.liveness | nindent 2 }}
readinessProbe:
  httpGet:
    path: /health
    port: http
    {{- if .Values.tls.enabled }}
    scheme: HTTPS
    {{- end }}
  {{- toYaml .Values.probes.readiness | nindent 2 }}
{{- end }}

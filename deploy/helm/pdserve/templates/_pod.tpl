{{/*
The pod template every workload uses. dict: root, component, ports (YAML list), env (YAML list of the
role's own variables), probes (YAML). Prefill/decode additionally get the engine ConfigMap, the KV
transfer settings, /dev/shm and (with RDMA) the RDMA device, IPC_LOCK and optionally hostIPC.
*/}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root }}
{{- $component := .component }}
{{- $values := index $root.Values $component }}
{{- $engine := has $component (list "prefill" "decode") }}
{{- $rdma := and $engine $root.Values.kvTransfer.rdma.enabled }}
{{- $securityContext := deepCopy $root.Values.securityContext }}
{{- if $rdma }}
{{- $capabilities := default (dict) $securityContext.capabilities }}
{{- $_ := set $capabilities "add" (append (default (list) $capabilities.add) "IPC_LOCK") }}
{{- $_ := set $securityContext "capabilities" $capabilities }}
{{- end }}
{{- $resources := deepCopy (default (dict) $values.resources) }}
{{- $devices := dict }}
{{- if gt (int $values.gpus) 0 }}
{{- /* a scheduler's TP ranks are processes of its pod, each on its own GPUs */}}
{{- $_ := set $devices "nvidia.com/gpu" (mul (int $values.gpus) (ternary (int (default $root.Values.engine.tpSize $values.tpSize)) 1 $engine)) }}
{{- end }}
{{- if $rdma }}
{{- $_ := set $devices $root.Values.kvTransfer.rdma.resourceName (int $root.Values.kvTransfer.rdma.resourceCount) }}
{{- end }}
{{- if $devices }}
{{- $_ := set $resources "limits" (mergeOverwrite (default (dict) $resources.limits) $devices) }}
{{- $_ := set $resources "requests" (mergeOverwrite (default (dict) $resources.requests) $devices) }}
{{- end }}
{{- $source := $root.Values.model.source -}}
{{- $tls := $root.Values.tls -}}
{{- $publicTls := and $tls.enabled $tls.publicSecretName (eq $component "gateway") -}}
metadata:
  labels:
    {{- include "pdserve.componentLabels" (list $root $component) | nindent 4 }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- with $values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
  automountServiceAccountToken: false
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- if and $rdma $root.Values.kvTransfer.rdma.hostIPC }}
  hostIPC: true
  {{- end }}
  {{- with $values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ include "pdserve.terminationGrace" (list $root $component) }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if eq $source.type "initContainer" }}
  initContainers:
    - name: fetch-model
      image: {{ $source.initContainer.image }}
      {{- with $source.initContainer.command }}
      command:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $source.initContainer.args }}
      args:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        - name: MODEL_DIR
          value: {{ $source.mountPath }}
        {{- with $source.initContainer.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      {{- with $source.initContainer.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: model
          mountPath: {{ $source.mountPath }}
  {{- end }}
  containers:
    - name: {{ $component }}
      image: {{ include "pdserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args:
        - {{ $component }}
        {{- with $values.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        {{- .ports | nindent 8 }}
        {{- if $tls.enabled }}
        - name: health
          containerPort: {{ int $tls.healthPort }}
          protocol: TCP
        {{- end }}
        - name: metrics
          containerPort: {{ int $root.Values.metrics.port }}
          protocol: TCP
      envFrom:
        - configMapRef:
            name: {{ include "pdserve.fullname" $root }}-common
        {{- if $engine }}
        - configMapRef:
            name: {{ include "pdserve.fullname" $root }}-engine
        {{- end }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        - name: HOME
          value: /tmp
        - name: PDSERVE_HOST
          value: 0.0.0.0
        {{- with $root.Values.model.hub }}
        {{- if and .enabled .tokenSecret.name }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ .tokenSecret.name }}
              key: {{ .tokenSecret.key }}
        {{- end }}
        {{- end }}
        {{- .env | nindent 8 }}
        {{- if $engine }}
        {{- with $root.Values.kvTransfer.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with $values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- .probes | nindent 6 }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: cache
          mountPath: {{ $root.Values.cache.mountPath }}
        {{- if ne $source.type "none" }}
        - name: model
          mountPath: {{ $source.mountPath }}
          readOnly: true
        {{- end }}
        {{- if and $engine $root.Values.kvTransfer.shm.enabled }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- if $tls.enabled }}
        - name: tls
          mountPath: /etc/pdserve/tls
          readOnly: true
        {{- end }}
        {{- if $publicTls }}
        - name: public-tls
          mountPath: /etc/pdserve/public-tls
          readOnly: true
        {{- end }}
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: {{ $root.Values.scratch.sizeLimit }}
    - name: cache
      {{- if eq $root.Values.cache.type "pvc" }}
      persistentVolumeClaim:
        claimName: {{ include "pdserve.cacheClaimName" $root }}
      {{- else if eq $root.Values.cache.type "hostPath" }}
      hostPath:
        {{- toYaml $root.Values.cache.hostPath | nindent 8 }}
      {{- else }}
      emptyDir:
        {{- toYaml $root.Values.cache.emptyDir | nindent 8 }}
      {{- end }}
    {{- if eq $source.type "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $source.pvc.claimName }}
        readOnly: true
    {{- else if eq $source.type "hostPath" }}
    - name: model
      hostPath:
        {{- toYaml $source.hostPath | nindent 8 }}
    {{- else if eq $source.type "initContainer" }}
    - name: model
      emptyDir:
        sizeLimit: {{ $source.initContainer.sizeLimit }}
    {{- end }}
    {{- if and $engine $root.Values.kvTransfer.shm.enabled }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.kvTransfer.shm.sizeLimit }}
    {{- end }}
    {{- if $tls.enabled }}
    - name: tls
      secret:
        secretName: {{ $tls.secretName }}
        defaultMode: 0440
    {{- end }}
    {{- if $publicTls }}
    - name: public-tls
      secret:
        secretName: {{ $tls.publicSecretName }}
        defaultMode: 0440
    {{- end }}
{{- end }}

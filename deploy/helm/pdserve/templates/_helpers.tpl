{{/* Names: <release>-pdserve, or the release name when it already says pdserve. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include with (dict "root" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "pdserve.etcdName" -}}
{{ include "pdserve.fullname" . }}-etcd
{{- end -}}

{{- define "pdserve.etcdEndpoint" -}}
{{- if .Values.etcd.enabled -}}
{{ ternary "https" "http" .Values.tls.enabled }}://{{ include "pdserve.etcdName" . }}:2379
{{- else if .Values.etcd.externalEndpoint -}}
{{- if and .Values.tls.enabled .Values.tls.require (not (hasPrefix "https://" .Values.etcd.externalEndpoint)) -}}
{{ fail "tls.require: etcd.externalEndpoint must be https://HOST:PORT (an etcd serving TLS that trusts tls's CA)" }}
{{- end -}}
{{ .Values.etcd.externalEndpoint }}
{{- else -}}
{{ fail "etcd.enabled is false: set etcd.externalEndpoint (http://HOST:PORT)" }}
{{- end -}}
{{- end -}}

{{- define "pdserve.clusterSecretName" -}}
{{ .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) }}
{{- end -}}

{{- define "pdserve.apiKeySecretName" -}}
{{ .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "pdserve.fullname" .)) }}
{{- end -}}

{{- define "pdserve.adminKeySecretName" -}}
{{ .Values.adminKey.existingSecret | default (printf "%s-admin-key" (include "pdserve.fullname" .)) }}
{{- end -}}

{{- define "pdserve.adminKeyEnabled" -}}
{{- if or .Values.adminKey.existingSecret .Values.adminKey.create -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.apiKeyEnabled" -}}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.create -}}true{{- end -}}
{{- end -}}

{{/* The pod security settings of every pdserve pod: the image's non-root user. */}}
{{- define "pdserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pdserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Settings every pdserve process reads (PDSERVE_<FLAG>). */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_HOST
  value: "0.0.0.0"
- name: PDSERVE_ETCD
  value: {{ include "pdserve.etcdEndpoint" . | quote }}
- name: PDSERVE_CLUSTER
  value: {{ .Values.cluster | quote }}
- name: PDSERVE_CLUSTER_SECRET_FILE
  value: /etc/pdserve/cluster-secret/{{ .Values.clusterSecret.secretKey }}
- name: PDSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: PDSERVE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: PDSERVE_MAX_MODEL_LEN
  value: {{ .Values.model.maxModelLen | quote }}
{{- with .Values.model.path }}
- name: PDSERVE_MODEL
  value: {{ . | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: PDSERVE_TLS_CERT
  value: /etc/pdserve/tls/tls.crt
- name: PDSERVE_TLS_KEY
  value: /etc/pdserve/tls/tls.key
- name: PDSERVE_TLS_CA
  value: /etc/pdserve/tls/ca.crt
- name: PDSERVE_REQUIRE_TLS
  value: {{ .Values.tls.require | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.clusterSecretVolume" -}}
- name: cluster-secret
  secret:
    secretName: {{ include "pdserve.clusterSecretName" . }}
    defaultMode: 0440
{{- end -}}

{{- define "pdserve.clusterSecretMount" -}}
- name: cluster-secret
  mountPath: /etc/pdserve/cluster-secret
  readOnly: true
{{- end -}}

{{/* tls.enabled: the kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt) every pod
     mounts at /etc/pdserve/tls: tls.existingSecret, or the one the chart's cert-manager
     Certificate writes (templates/tls.yaml). */}}
{{- define "pdserve.tlsSecretName" -}}
{{ .Values.tls.existingSecret | default (printf "%s-tls" (include "pdserve.fullname" .)) }}
{{- end -}}

{{- define "pdserve.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" . }}
    defaultMode: 0440
{{- end -}}

{{- define "pdserve.tlsMount" -}}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end -}}

{{/* The name a worker pod advertises under tls (gRPC and KV): its IP, dashed, under its
     role's headless Service, which the certificate covers with a wildcard. Include with
     (dict "root" $ "service" NAME). */}}
{{- define "pdserve.workerDnsSuffix" -}}
{{ .service }}.{{ .root.Release.Namespace }}.svc.{{ .root.Values.tls.clusterDomain }}
{{- end -}}

{{/* The cluster KV store (kvStore): the chart's own Redis when kvStore.url is empty. */}}
{{- define "pdserve.kvStoreOwn" -}}
{{- if and .Values.kvStore.enabled (not .Values.kvStore.url) -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.redisName" -}}
{{ include "pdserve.fullname" . }}-redis
{{- end -}}

{{- define "pdserve.kvStoreUrl" -}}
{{- with .Values.kvStore.url -}}
{{- if contains "@" . -}}
{{ fail "kvStore.url must not carry a password (the workers would log it): put it in a Secret, kvStore.password.existingSecret" }}
{{- end -}}
{{- if and (not (hasPrefix "rediss" .)) $.Values.kvStore.tls.enabled -}}
{{ fail "kvStore.tls.enabled: kvStore.url must be rediss://HOST:PORT or rediss-cluster://HOST:PORT[,...] (a Redis serving TLS)" }}
{{- end -}}
{{- if and (not (hasPrefix "rediss" .)) $.Values.tls.enabled $.Values.tls.require -}}
{{ fail "tls.require: kvStore.url must be rediss://HOST:PORT or rediss-cluster://HOST:PORT[,...] (--require-tls refuses a plaintext store)" }}
{{- end -}}
{{ . }}
{{- else -}}
{{ ternary "rediss" "redis" (eq (include "pdserve.kvStoreTls" .) "true") }}://{{ include "pdserve.redisName" . }}:6379
{{- end -}}
{{- end -}}

{{/* TLS to the store: an external URL says itself (rediss://); the chart's own Redis
     serves TLS only under tls.enabled or kvStore.tls.enabled. */}}
{{- define "pdserve.kvStoreTls" -}}
{{- if .Values.kvStore.enabled -}}
{{- if .Values.kvStore.url -}}
{{- if hasPrefix "rediss" .Values.kvStore.url -}}true{{- end -}}
{{- else if or .Values.kvStore.tls.enabled .Values.tls.enabled -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Secret (tls.crt, tls.key, ca.crt) of TLS to the store: kvStore.tls.existingSecret,
     else tls's (the workers have it as --tls-*); empty: none (an external rediss:// store
     then is verified against the system's roots, and no client certificate is sent). */}}
{{- define "pdserve.kvStoreTlsSecret" -}}
{{- if include "pdserve.kvStoreTls" . -}}
{{- if .Values.kvStore.tls.existingSecret -}}
{{ .Values.kvStore.tls.existingSecret }}
{{- else if .Values.tls.enabled -}}
{{ include "pdserve.tlsSecretName" . }}
{{- else if include "pdserve.kvStoreOwn" . -}}
{{ fail "kvStore.tls.enabled: the chart's Redis needs a certificate: kvStore.tls.existingSecret (a kubernetes.io/tls Secret with ca.crt) or tls.enabled" }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.kvStoreTlsVolume" -}}
- name: kv-store-tls
  secret:
    secretName: {{ include "pdserve.kvStoreTlsSecret" . }}
    defaultMode: 0440
{{- end -}}

{{- define "pdserve.kvStoreTlsMount" -}}
- name: kv-store-tls
  mountPath: /etc/pdserve/kv-store-tls
  readOnly: true
{{- end -}}

{{/* Whether the workers send a password: always to the chart's own Redis (generated
     unless existingSecret), to an external store only with existingSecret. */}}
{{- define "pdserve.kvStorePassword" -}}
{{- if and .Values.kvStore.enabled (or .Values.kvStore.password.existingSecret (include "pdserve.kvStoreOwn" .)) -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.kvStoreSecretName" -}}
{{ .Values.kvStore.password.existingSecret | default (printf "%s-kv-store" (include "pdserve.fullname" .)) }}
{{- end -}}

{{/* A prefill or decode worker's store flags (PDSERVE_KV_STORE*, PDSERVE_KV_COMPRESSION). */}}
{{- define "pdserve.kvStoreEnv" -}}
{{- if .Values.kvStore.enabled }}
- name: PDSERVE_KV_STORE
  value: {{ include "pdserve.kvStoreUrl" . | quote }}
- name: PDSERVE_KV_STORE_TTL_S
  value: {{ .Values.kvStore.ttlSeconds | quote }}
- name: PDSERVE_KV_STORE_TIMEOUT_S
  value: {{ .Values.kvStore.timeoutSeconds | quote }}
- name: PDSERVE_KV_COMPRESSION
  value: {{ .Values.kvStore.compression | quote }}
- name: PDSERVE_KV_STORE_ADMISSION
  value: {{ .Values.kvStore.admission | quote }}
{{- if include "pdserve.kvStorePassword" . }}
- name: PDSERVE_KV_STORE_PASSWORD_FILE
  value: /etc/pdserve/kv-store/{{ .Values.kvStore.password.secretKey }}
{{- end }}
{{- if and .Values.kvStore.tls.existingSecret (include "pdserve.kvStoreTls" .) }}
- name: PDSERVE_KV_STORE_TLS_CA
  value: /etc/pdserve/kv-store-tls/ca.crt
- name: PDSERVE_KV_STORE_TLS_CERT
  value: /etc/pdserve/kv-store-tls/tls.crt
- name: PDSERVE_KV_STORE_TLS_KEY
  value: /etc/pdserve/kv-store-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.kvStoreVolume" -}}
- name: kv-store-password
  secret:
    secretName: {{ include "pdserve.kvStoreSecretName" . }}
    defaultMode: 0440
{{- end -}}

{{- define "pdserve.kvStoreMount" -}}
- name: kv-store-password
  mountPath: /etc/pdserve/kv-store
  readOnly: true
{{- end -}}

{{/* The workers' LoRA flags (values.lora), as PDSERVE_* variables. */}}
{{- define "pdserve.loraEnv" -}}
{{- if .Values.lora.enabled }}
- name: PDSERVE_ENABLE_LORA
  value: "true"
- name: PDSERVE_MAX_LORAS
  value: {{ .Values.lora.maxLoras | quote }}
- name: PDSERVE_MAX_LORA_RANK
  value: {{ .Values.lora.maxLoraRank | quote }}
{{- with .Values.lora.modules }}
- name: PDSERVE_LORA_MODULES
  value: {{ include "pdserve.loraModules" $ | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.loraModules" -}}
{{- $modules := list }}
{{- range .Values.lora.modules }}
{{- $modules = append $modules (printf "%s=%s" .name .path) }}
{{- end }}
{{- join " " $modules }}
{{- end -}}

{{/* Names and labels. */}}
{{- define "hloserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "hloserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hloserve.labels" -}}
{{ include "hloserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "hloserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The Service the workers are found through, in fleet mode (headless). */}}
{{- define "hloserve.workersService" -}}
{{ include "hloserve.fullname" . | trunc 55 | trimSuffix "-" }}-workers
{{- end -}}

{{/* What values.schema.json cannot say; each failure names the value and what to set. */}}
{{- define "hloserve.validate" -}}
{{- $repo := .Values.modelRepository -}}
{{- $sources := 0 -}}
{{- if $repo.pvc.claimName }}{{ $sources = add1 $sources }}{{ end -}}
{{- if $repo.hostPath.path }}{{ $sources = add1 $sources }}{{ end -}}
{{- if $repo.initContainer.image }}{{ $sources = add1 $sources }}{{ end -}}
{{- if ne $sources 1 -}}
{{- fail (printf "modelRepository: set exactly one of modelRepository.pvc.claimName, modelRepository.hostPath.path or modelRepository.initContainer.image (where the bundles come from); %d are set" $sources) -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.secretName: name the kubernetes.io/tls Secret (tls.crt, tls.key; ca.crt with tls.mutual) when tls.enabled is true" -}}
{{- end -}}
{{- if and .Values.tls.metrics (not .Values.tls.enabled) -}}
{{- fail "tls.metrics: the metrics port serves the certificate of tls.secretName; set tls.enabled too" -}}
{{- end -}}
{{- if and .Values.tls.metrics (eq .Values.mode "fleet") -}}
{{- fail "tls.metrics: not with mode: fleet, where the routers would serve HTTPS and the workers behind them plain text to one ServiceMonitor; scrape the fleet in the cluster without it" -}}
{{- end -}}
{{- if and .Values.tracing.enabled (not .Values.tracing.endpoint) -}}
{{- fail "tracing.endpoint: name the OTLP/gRPC collector (e.g. http://otel-collector:4317) when tracing.enabled is true" -}}
{{- end -}}
{{- if and (ne .Values.mode "node") (gt (int .Values.gpus) 1) -}}
{{- fail (printf "gpus: a %s pod runs one worker on at most one GPU, not %v; for several GPUs in one pod use mode: node, or more replicas" .Values.mode .Values.gpus) -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations: Prometheus' scrape annotations, a checksum of the config, the user's. */}}
{{- define "hloserve.podAnnotations" -}}
{{- $annotations := dict "checksum/config" (include (print .Template.BasePath "/configmap.yaml") . | sha256sum) -}}
{{- if .Values.metrics.podAnnotations -}}
{{- $_ := set $annotations "prometheus.io/scrape" "true" -}}
{{- $_ := set $annotations "prometheus.io/port" (toString .Values.ports.metrics) -}}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" -}}
{{- if .Values.tls.metrics }}{{ $_ := set $annotations "prometheus.io/scheme" "https" }}{{ end -}}
{{- end -}}
{{- toYaml (merge (deepCopy .Values.podAnnotations) $annotations) -}}
{{- end -}}

{{/* Container ports, named as KServe and Knative read them (grpc: HTTP/2 cleartext). */}}
{{- define "hloserve.ports" -}}
- name: grpc
  containerPort: {{ .Values.ports.grpc }}
  protocol: TCP
- name: metrics
  containerPort: {{ .Values.ports.metrics }}
  protocol: TCP
{{- if .Values.http.enabled }}
- name: http
  containerPort: {{ .Values.ports.http }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/*
gRPC probes (grpc.health.v1), given (dict "root" . "tls" <this container serves TLS>): the port opens once the repository is compiled, so the startup
probe waits for compilation; liveness asks the inference service, which a bundle that failed
to load does not fail; readiness asks the whole server (every bundle ready), as ServerReady.
*/}}
{{- define "hloserve.probes" -}}
{{- $tls := .tls -}}
{{- with .root -}}
{{- $p := .Values.probes -}}
{{- if or $tls (include "hloserve.healthHeader" .Values.restricted.grpc) -}}
{{- include "hloserve.otherProbes" (dict "root" . "tls" $tls) -}}
{{- else -}}
startupProbe:
  grpc:
    port: {{ .Values.ports.grpc }}
    service: inference.GRPCInferenceService
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ .Values.ports.grpc }}
    service: inference.GRPCInferenceService
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
readinessProbe:
  grpc:
    port: {{ .Values.ports.grpc }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The `<key>=<value>` of the restriction entry (of a list) that names the `health` group, or "".
*/}}
{{- define "hloserve.healthHeader" -}}
{{- range . -}}
{{- $entry := splitn ":" 2 . -}}
{{- if has "health" (splitList "," $entry._0) }}{{ $entry._1 }}{{ end -}}
{{- end -}}
{{- end -}}

{{/*
Probes when gRPC's cannot serve (TLS, or a restricted health group): REST's health over HTTP(S)
with the health restriction's header, when REST is on and no client certificate is required;
else a TCP connection to the gRPC port.
*/}}
{{- define "hloserve.otherProbes" -}}
{{- $tls := .tls -}}
{{- $root := .root -}}
{{- with .root -}}
{{- $p := .Values.probes -}}
{{- $header := include "hloserve.healthHeader" .Values.restricted.http -}}
{{- range $name, $path := dict "startupProbe" "/v2/health/live" "livenessProbe" "/v2/health/live" "readinessProbe" "/v2/health/ready" }}
{{ $name }}:
  {{- if and $root.Values.http.enabled (not (and $tls $root.Values.tls.mutual)) }}
  httpGet:
    path: {{ $path }}
    port: {{ $root.Values.ports.http }}
    scheme: {{ $tls | ternary "HTTPS" "HTTP" }}
    {{- if $header }}
    {{- $kv := splitn "=" 2 $header }}
    httpHeaders:
      - name: {{ $kv._0 }}
        value: {{ $kv._1 | quote }}
    {{- end }}
  {{- else }}
  tcpSocket:
    port: {{ $root.Values.ports.grpc }}
  {{- end }}
  {{- $settings := get $p (trimSuffix "Probe" $name) }}
  periodSeconds: {{ $settings.periodSeconds }}
  failureThreshold: {{ $settings.failureThreshold }}
  {{- with $settings.timeoutSeconds }}
  timeoutSeconds: {{ . }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The restrictions and TLS settings of a container, as hloserve's environment; `tls` says whether
this container serves TLS (fleet workers behind the routers do not).
*/}}
{{- define "hloserve.accessEnv" -}}
{{- $values := .root.Values -}}
{{- with $values.restricted.grpc }}
- name: HLOSERVE_SERVER_GRPC_RESTRICTED_PROTOCOL
  value: {{ join ";" . | quote }}
{{- end }}
{{- with $values.restricted.http }}
- name: HLOSERVE_SERVER_HTTP_RESTRICTED_API
  value: {{ join ";" . | quote }}
{{- end }}
{{- if .tls }}
{{- if $values.tls.metrics }}
- name: HLOSERVE_SERVER_METRICS_USE_SSL
  value: "true"
{{- end }}
{{- range $proto := list "GRPC" "HTTP" }}
- name: HLOSERVE_SERVER_{{ $proto }}_USE_SSL
  value: "true"
- name: HLOSERVE_SERVER_{{ $proto }}_SERVER_CERT
  value: /etc/hloserve-tls/tls.crt
- name: HLOSERVE_SERVER_{{ $proto }}_SERVER_KEY
  value: /etc/hloserve-tls/tls.key
{{- if $values.tls.mutual }}
- name: HLOSERVE_SERVER_{{ $proto }}_USE_SSL_MUTUAL
  value: "true"
- name: HLOSERVE_SERVER_{{ $proto }}_ROOT_CERT
  value: /etc/hloserve-tls/ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Tracing's OTEL_* variables, when `tracing.enabled`. */}}
{{- define "hloserve.tracingEnv" -}}
{{- with .Values.tracing }}
{{- if .enabled }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- with .serviceName }}
- name: OTEL_SERVICE_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* What every hloserve pod shares: pull secrets, security, the drain's grace. */}}
{{- define "hloserve.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- end -}}

{{/* Where the workers and nodes run (routers run anywhere). */}}
{{- define "hloserve.placement" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

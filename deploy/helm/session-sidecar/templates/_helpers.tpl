{{/*
Expand the name of the chart.
*/}}
{{- define "session-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "session-sidecar.fullname" -}}
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

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "session-sidecar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "session-sidecar.labels" -}}
helm.sh/chart: {{ include "session-sidecar.chart" . }}
{{ include "session-sidecar.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels
*/}}
{{- define "session-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "session-sidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "session-sidecar.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "session-sidecar.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The sidecar container spec, shared by this chart's Deployment and by any chart that runs
the sidecar next to its own router (as a container, or as a native sidecar init container).

Call it with a dict:
  values         (required) a map shaped like this chart's values.yaml: upstream, mode,
                 modeOptions, image, ports, securityContext, resources, probes, ...
  appVersion     image tag used when values.image.tag is empty
  configMapName  ConfigMap holding config.yaml; when set, the container mounts the pod
                 volume `session-sidecar-config` (the caller declares it) at /etc/sidecar
  name           container name (default "session-sidecar")
  restartPolicy  "Always" turns an init container into a native sidecar (Kubernetes >= 1.29)

  containers:
    {{- include "session-sidecar.container" (dict "values" .Values.sessionSidecar "appVersion" "0.1.0") | nindent 4 }}

Fails when values.upstream is empty, unless values.config lists `deployments` (the
multi-upstream form, where each deployment carries its own upstreams and mode).
*/}}
{{- define "session-sidecar.container" -}}
{{- $v := .values -}}
{{- $config := $v.config | default dict }}
{{- $deployments := and (kindIs "map" $config) (hasKey $config "deployments") }}
{{- if not (or $v.upstream $deployments) }}
{{- fail "session-sidecar: `upstream` is required: set it to the router URL the sidecar forwards to, e.g. --set upstream=http://my-router:8000 (or list several under config.deployments)" }}
{{- end }}
{{- $image := $v.image | default dict }}
{{- $tag := $image.tag | default .appVersion | default "latest" }}
{{- $ports := $v.ports | default dict }}
{{- $httpPort := $ports.http | default 8080 }}
{{- $adminPort := $ports.admin | default 9091 -}}
- name: {{ .name | default "session-sidecar" }}
  image: "{{ $image.repository | default "ghcr.io/example/session-sidecar" }}:{{ $tag }}"
  imagePullPolicy: {{ $image.pullPolicy | default "IfNotPresent" }}
  {{- with .restartPolicy }}
  restartPolicy: {{ . }}
  {{- end }}
  args: ["run"]
  env:
    {{- with $v.upstream }}
    - name: SIDECAR_UPSTREAM
      value: {{ . | quote }}
    {{- end }}
    - name: SIDECAR_LISTEN
      value: "0.0.0.0:{{ $httpPort }}"
    - name: SIDECAR_ADMIN
      value: "0.0.0.0:{{ $adminPort }}"
    {{- with $v.mode }}
    - name: SIDECAR_MODE
      value: {{ . | quote }}
    {{- end }}
    {{- with $v.modeOptions }}
    {{- $opts := list }}
    {{- range $key, $val := . }}
    {{- $opts = append $opts (printf "%s=%v" $key $val) }}
    {{- end }}
    - name: SIDECAR_MODE_OPTS
      value: {{ join "," $opts | quote }}
    {{- end }}
    {{- with $v.engine }}
    - name: SIDECAR_ENGINE
      value: {{ . | quote }}
    {{- end }}
    {{- with $v.logLevel }}
    - name: SIDECAR_LOG_LEVEL
      value: {{ . | quote }}
    {{- end }}
    {{- if .configMapName }}
    - name: SIDECAR_CONFIG
      value: /etc/sidecar/config.yaml
    {{- end }}
    {{- with $v.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: http
      containerPort: {{ $httpPort }}
      protocol: TCP
    - name: admin
      containerPort: {{ $adminPort }}
      protocol: TCP
  {{- with $v.startupProbe }}
  startupProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .configMapName }}
  volumeMounts:
    - name: session-sidecar-config
      mountPath: /etc/sidecar
      readOnly: true
  {{- end }}
{{- end }}

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
Name of the Secret holding the sessions API tokens file (key `tokens.yaml`), or "" when the
sessions API runs without tokens (adminInsecure). Fails on contradicting values.
*/}}
{{- define "session-sidecar.adminTokensSecretName" -}}
{{- $tokens := .Values.adminTokens | default dict }}
{{- if and $tokens.tokens (or (not $tokens.create) $tokens.existingSecret .Values.adminInsecure) }}
{{- fail "session-sidecar: adminTokens.tokens is set but the chart creates no tokens Secret (adminTokens.create=false, adminTokens.existingSecret or adminInsecure=true): the tokens would be ignored" }}
{{- end }}
{{- if .Values.adminInsecure }}
{{- if $tokens.existingSecret }}
{{- fail "session-sidecar: set either adminTokens.existingSecret or adminInsecure=true, not both" }}
{{- end }}
{{- else if $tokens.existingSecret }}
{{- $tokens.existingSecret }}
{{- else if $tokens.create }}
{{- printf "%s-admin-tokens" (include "session-sidecar.fullname" .) }}
{{- end }}
{{- end }}

{{/*
True ("true") when this chart creates the tokens Secret itself.
*/}}
{{- define "session-sidecar.createAdminTokens" -}}
{{- $tokens := .Values.adminTokens | default dict }}
{{- if and .Values.standalone $tokens.create (not $tokens.existingSecret) (not .Values.adminInsecure) }}true{{ end }}
{{- end }}

{{/*
Fails on a token of adminTokens.tokens that is a placeholder or too short: the chart would
otherwise ship a token that anyone reading the example knows.
*/}}
{{- define "session-sidecar.checkTokens" -}}
{{- range $i, $entry := . }}
{{- $token := toString ($entry.token | default "") }}
{{- if or (lt (len $token) 16) (regexMatch "\\s" $token) }}
{{- fail (printf "session-sidecar: adminTokens.tokens[%d].token must be at least 16 characters without spaces (generate one with `openssl rand -hex 32`)" $i) }}
{{- end }}
{{- if regexMatch "(?i)change[-_ ]?me|replace|placeholder|example|^<.*>$" $token }}
{{- fail (printf "session-sidecar: adminTokens.tokens[%d].token is a placeholder: replace it with a random token (`openssl rand -hex 32`); the sidecar refuses placeholder tokens too" $i) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Content of the tokens file the chart creates: the tokens of adminTokens.tokens when given, else
the existing Secret's (found with `lookup`, so the token survives upgrades), else one new admin
token of 32 random characters. Computed once
per render and remembered, so the Secret and the Deployment's checksum/admin-tokens agree even
where `lookup` finds nothing (first install, `helm template`).
*/}}
{{- define "session-sidecar.adminTokensFile" -}}
{{- $name := include "session-sidecar.adminTokensSecretName" . }}
{{- $memo := printf "sessionSidecarAdminTokensFile/%s" $name }}
{{- if not (hasKey .Release $memo) }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name | default dict }}
{{- $data := dig "data" "tokens.yaml" "" $existing }}
{{- $file := "" }}
{{- $given := (.Values.adminTokens | default dict).tokens }}
{{- if $given }}
{{- include "session-sidecar.checkTokens" $given }}
{{- $file = printf "# Bearer tokens of the sessions API (admin_tokens_file), from the Helm values adminTokens.tokens.\n%s" (dict "tokens" $given | toYaml) }}
{{- else if $data }}
{{- $file = b64dec $data }}
{{- else }}
{{- $file = printf "# Bearer tokens of the sessions API (admin_tokens_file), generated by the Helm chart.\ntokens:\n  - token: %s\n    admin: true\n" (randAlphaNum 32) }}
{{- end }}
{{- $_ := set .Release $memo $file }}
{{- end }}
{{- index .Release $memo }}
{{- end }}

{{/*
Built-in routing modes (the `sidecar.modes` entry points of pyproject.toml), one per line.
*/}}
{{- define "session-sidecar.builtinModes" -}}
dynamo_headers
dynamo_nvext
smg_routing_key
session_id_header
identity_headers
vllm_router
llmd_session_token
{{- end }}

{{/*
The sidecar config of a values map as a dict, whether `config` is a mapping or a YAML string:
  {{- $config := include "session-sidecar.configData" .Values | fromJson }}
*/}}
{{- define "session-sidecar.configData" -}}
{{- $config := .config | default dict }}
{{- if kindIs "string" $config }}
{{- $config = fromYaml $config }}
{{- if hasKey $config "Error" }}
{{- fail (printf "session-sidecar: `config` is a string but not a YAML mapping: %s" $config.Error) }}
{{- end }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/*
Fails when a mode named in the values (mode, config.mode, config.deployments[].mode) is
neither built in nor listed in customModes. The schema checks the built-in names already;
this check also covers customModes and a `config` given as a YAML string.
*/}}
{{- define "session-sidecar.checkModes" -}}
{{- $allowed := concat (splitList "\n" (include "session-sidecar.builtinModes" .)) (.customModes | default list) }}
{{- $config := include "session-sidecar.configData" . | fromJson }}
{{- $named := dict }}
{{- with .mode }}{{ $_ := set $named "mode" . }}{{ end }}
{{- with $config.mode }}{{ $_ := set $named "config.mode" . }}{{ end }}
{{- range $i, $d := $config.deployments | default list }}
{{- if kindIs "map" $d }}
{{- with $d.mode }}{{ $_ := set $named (printf "config.deployments[%d].mode" $i) . }}{{ end }}
{{- end }}
{{- end }}
{{- range $where, $mode := $named }}
{{- if not (has $mode $allowed) }}
{{- fail (printf "session-sidecar: %s: unknown mode %q: use one of %s, or list a plugin mode your image installs in customModes" $where $mode (join ", " $allowed)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
terminationGracePeriodSeconds of the pod: the sidecar's shutdown_delay_seconds (default 5) +
drain_grace_seconds (default 25) + terminationGraceMarginSeconds, or the value given, which
must not be smaller. Also fails when the readiness probe cannot notice the 503 of /readyz
within the shutdown delay.
*/}}
{{- define "session-sidecar.terminationGracePeriodSeconds" -}}
{{- $config := include "session-sidecar.configData" .Values | fromJson }}
{{- $delay := hasKey $config "shutdown_delay_seconds" | ternary $config.shutdown_delay_seconds 5 | float64 }}
{{- $grace := hasKey $config "drain_grace_seconds" | ternary $config.drain_grace_seconds 25 | float64 }}
{{- $margin := .Values.terminationGraceMarginSeconds | default 0 | float64 }}
{{- $needed := addf $delay $grace $margin | ceil | int }}
{{- $probe := .Values.readinessProbe | default dict }}
{{- if and (gt $delay 0.0) $probe }}
{{- $noticed := mul ($probe.periodSeconds | default 10) ($probe.failureThreshold | default 3) }}
{{- if gt (float64 $noticed) $delay }}
{{- fail (printf "session-sidecar: readinessProbe.periodSeconds x failureThreshold = %ds exceeds config.shutdown_delay_seconds (%vs): the pod would still be ready when the sidecar stops accepting connections; lower the probe's periodSeconds or failureThreshold, or raise config.shutdown_delay_seconds" (int $noticed) $delay) }}
{{- end }}
{{- end }}
{{- $given := .Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $given }}
{{- $needed }}
{{- else if lt (int $given) $needed }}
{{- fail (printf "session-sidecar: terminationGracePeriodSeconds=%d is shorter than config.shutdown_delay_seconds (%v) + config.drain_grace_seconds (%v) + terminationGraceMarginSeconds (%v) = %d: the kubelet would kill in-flight requests; leave it empty (null) to derive it, or raise it" (int $given) $delay $grace $margin $needed) }}
{{- else }}
{{- int $given }}
{{- end }}
{{- end }}

{{/*
Names and labels of the chart's Valkey. Its pods get their own app.kubernetes.io/name, so
the sidecar's Service, Deployment and ServiceMonitor selectors never match them.
*/}}
{{- define "session-sidecar.valkey.fullname" -}}
{{- printf "%s-valkey" (include "session-sidecar.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "session-sidecar.valkey.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-valkey" (include "session-sidecar.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: valkey
{{- end }}

{{- define "session-sidecar.valkey.labels" -}}
helm.sh/chart: {{ include "session-sidecar.chart" . }}
{{ include "session-sidecar.valkey.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The Secret holding the Valkey password (key `password`).
*/}}
{{- define "session-sidecar.valkey.secretName" -}}
{{- .Values.valkey.auth.existingSecret | default (include "session-sidecar.valkey.fullname" .) }}
{{- end }}

{{/*
The generated Valkey password: the existing Secret's (`lookup`), else 32 random characters;
computed once per render.
*/}}
{{- define "session-sidecar.valkey.password" -}}
{{- $memo := "sessionSidecarValkeyPassword" }}
{{- if not (hasKey .Release $memo) }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "session-sidecar.valkey.fullname" .) | default dict }}
{{- $data := dig "data" "password" "" $existing }}
{{- $_ := set .Release $memo (empty $data | ternary (randAlphaNum 32) (b64dec $data)) }}
{{- end }}
{{- index .Release $memo }}
{{- end }}

{{/*
The shared store of the standalone Deployment as a dict {url, secret, key, effective}: url is
what SIDECAR_STATE gets (empty: none), effective the store the sidecar ends up with: state.url, else
the chart's Valkey when valkey.enabled, else config.state.url (then the sidecar reads it from
the file). Fails on contradicting values, and on replicaCount > 1 with the in-memory store.
*/}}
{{- define "session-sidecar.state" -}}
{{- $state := .Values.state | default dict }}
{{- $config := include "session-sidecar.configData" .Values | fromJson }}
{{- $fileUrl := dig "state" "url" "" $config }}
{{- if and $state.url $fileUrl }}
{{- fail "session-sidecar: state.url and config.state.url are both set: set the store URL in one place (state.url)" }}
{{- end }}
{{- $out := dict "url" $state.url "secret" $state.existingSecret "key" ($state.passwordKey | default "password") }}
{{- if .Values.valkey.enabled }}
{{- if or $state.url $fileUrl }}
{{- fail "session-sidecar: valkey.enabled=true and a store URL (state.url or config.state.url) are both set: leave the URL empty to use the chart's Valkey, or turn valkey.enabled off to use your own store" }}
{{- end }}
{{- $_ := set $out "url" (printf "redis://%s:%v/0" (include "session-sidecar.valkey.fullname" .) .Values.valkey.port) }}
{{- $_ := set $out "secret" (include "session-sidecar.valkey.secretName" .) }}
{{- $_ := set $out "key" "password" }}
{{- end }}
{{- $effective := $out.url | default $fileUrl | default "memory://" }}
{{- if and (gt (int .Values.replicaCount) 1) (hasPrefix "memory://" $effective) }}
{{- fail (printf "session-sidecar: replicaCount=%v with the in-memory session store: each replica would keep its own session tree and API sessions. Set valkey.enabled=true (a Valkey in this release), or state.url=redis://HOST:6379/0 (your Redis or Valkey; password from state.existingSecret), or replicaCount=1" .Values.replicaCount) }}
{{- end }}
{{- $_ := set $out "effective" $effective }}
{{- toJson $out }}
{{- end }}

{{/*
The pod volume of the tokens Secret that `session-sidecar.container` mounts when called
with `tokensSecretName`:
  volumes:
    {{- include "session-sidecar.tokensVolume" (dict "secretName" "my-sidecar-tokens") | nindent 4 }}
*/}}
{{- define "session-sidecar.tokensVolume" -}}
- name: session-sidecar-tokens
  secret:
    secretName: {{ required "session-sidecar.tokensVolume: secretName is required" .secretName }}
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
  tokensSecretName  Secret holding the sessions API tokens file under key `tokens.yaml`; the
                 container mounts the pod volume `session-sidecar-tokens` (the caller declares
                 it, e.g. with "session-sidecar.tokensVolume") read-only at /etc/sidecar/tokens
                 and sets SIDECAR_ADMIN_TOKENS_FILE=/etc/sidecar/tokens/tokens.yaml
  state          the shared store as a dict {url, secret, key}: SIDECAR_STATE=url, and
                 SIDECAR_STATE_PASSWORD from key `key` of Secret `secret`; default
                 values.state {url, existingSecret, passwordKey}

  containers:
    {{- include "session-sidecar.container" (dict "values" .Values.sessionSidecar "appVersion" "0.1.0"
                                                  "tokensSecretName" "my-sidecar-tokens") | nindent 4 }}

The admin listener binds 0.0.0.0 (probes and Prometheus must reach it), so the sidecar only
starts with a tokens file or with the sessions API explicitly unauthenticated: without
tokensSecretName the template fails unless values.adminInsecure is true (then it sets
SIDECAR_ADMIN_INSECURE=true). It also fails when values.upstream is empty, unless
values.config lists `deployments` (the multi-upstream form, where each deployment carries its
own upstreams and mode).
*/}}
{{- define "session-sidecar.container" -}}
{{- $v := .values -}}
{{- $config := include "session-sidecar.configData" $v | fromJson }}
{{- $deployments := hasKey $config "deployments" }}
{{- include "session-sidecar.checkModes" $v }}
{{- $vstate := $v.state | default dict }}
{{- $state := .state | default (dict "url" $vstate.url "secret" $vstate.existingSecret "key" ($vstate.passwordKey | default "password")) }}
{{- if not (or $v.upstream $config.upstream $deployments) }}
{{- fail "session-sidecar: `upstream` is required: set it to the router URL the sidecar forwards to, e.g. --set upstream=http://my-router:8000 (or list several under config.deployments)" }}
{{- end }}
{{- if and .tokensSecretName $v.adminInsecure }}
{{- fail "session-sidecar: adminInsecure=true and a tokens Secret are both set: the sessions API is either protected by bearer tokens or explicitly unauthenticated, not both" }}
{{- end }}
{{- if not (or .tokensSecretName $v.adminInsecure) }}
{{- fail "session-sidecar: the sessions API on the admin port (bound to 0.0.0.0 for the probes) needs bearer tokens: keep adminTokens.create=true, set adminTokens.existingSecret to a Secret with key tokens.yaml (as a dependency: pass \"tokensSecretName\" to session-sidecar.container), or set adminInsecure=true to accept an unauthenticated sessions API" }}
{{- end }}
{{- $image := $v.image | default dict }}
{{- $tag := $image.tag | default .appVersion | default "latest" }}
{{- $ports := $v.ports | default dict }}
{{- $httpPort := $ports.http | default 8080 }}
{{- $adminPort := $ports.admin | default 9091 -}}
- name: {{ .name | default "session-sidecar" }}
  image: "{{ $image.repository | default "ghcr.io/session-sidecar/session-sidecar" }}:{{ $tag }}"
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
    {{- with $state.url }}
    - name: SIDECAR_STATE
      value: {{ . | quote }}
    {{- end }}
    {{- with $state.secret }}
    - name: SIDECAR_STATE_PASSWORD
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $state.key }}
    {{- end }}
    {{- if .tokensSecretName }}
    - name: SIDECAR_ADMIN_TOKENS_FILE
      value: /etc/sidecar/tokens/tokens.yaml
    {{- else }}
    # No bearer tokens: the sessions API (/v1/*, /ui/data.json) is open to anyone who reaches the admin port.
    - name: SIDECAR_ADMIN_INSECURE
      value: "true"
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
  {{- if or .configMapName .tokensSecretName $v.extraVolumeMounts }}
  volumeMounts:
    {{- if .configMapName }}
    - name: session-sidecar-config
      mountPath: /etc/sidecar
      readOnly: true
    {{- end }}
    {{- if .tokensSecretName }}
    - name: session-sidecar-tokens
      mountPath: /etc/sidecar/tokens
      readOnly: true
    {{- end }}
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
{{- end }}

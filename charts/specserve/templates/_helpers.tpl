{{/* Names: <release>-specserve (or fullnameOverride), then -gateway, -verifier, -drafter-<name>. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specserve.gatewayName" -}}{{ include "specserve.fullname" . }}-gateway{{- end -}}
{{- define "specserve.verifierName" -}}{{ include "specserve.fullname" . }}-verifier{{- end -}}

{{/* A drafter's resource name; (dict "root" $ "name" <drafter name>). Underscores are not allowed in names. */}}
{{- define "specserve.drafterName" -}}
{{- printf "%s-drafter-%s" (include "specserve.fullname" .root) (.name | replace "_" "-") | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end -}}

{{/* Selector labels of one workload; (dict "root" $ "component" "gateway|verifier|drafter" "drafter" name). */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .drafter }}
specserve.io/drafter: {{ .drafter | replace "_" "-" }}
{{- end }}
{{- end -}}

{{/* A pod's labels: its selector labels plus the version; same argument as specserve.selectorLabels. */}}
{{- define "specserve.podLabels" -}}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: specserve
{{- end -}}

{{/* repository:tag of an image entry; (dict "root" $ "image" {repository, tag}). */}}
{{- define "specserve.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* A drafter entry over drafterDefaults, key by key (a key given on the drafter replaces the default whole);
     (dict "root" $ "drafter" <entry> "out" <empty dict to fill>). */}}
{{- define "specserve.mergeDrafter" -}}
{{- range $key, $value := deepCopy .root.Values.drafterDefaults }}{{ $_ := set $.out $key $value }}{{ end -}}
{{- range $key, $value := deepCopy .drafter }}{{ $_ := set $.out $key $value }}{{ end -}}
{{- end -}}

{{/* Whether a drafter runs a model (so it needs the model volume and the drafterModel image). */}}
{{- define "specserve.drafterHasModel" -}}
{{- if or .model (has .method (list "draft_model" "eagle" "eagle3")) }}true{{ end -}}
{{- end -}}

{{/* The drafter's image entry: its own, else drafterModel for a method with a model, else drafter. */}}
{{- define "specserve.drafterImage" -}}
{{- $image := ternary .root.Values.images.drafterModel .root.Values.images.drafter (eq (include "specserve.drafterHasModel" .drafter) "true") -}}
{{- include "specserve.image" (dict "root" .root "image" (default $image .drafter.image)) -}}
{{- end -}}

{{/* The gateway's verifier target: every ready verifier pod, through the headless Service's DNS name. */}}
{{- define "specserve.verifierTarget" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "specserve.verifierName" .) .Release.Namespace .Values.clusterDomain (int .Values.ports.verifier) -}}
{{- end -}}

{{/* resources with the accelerator added to its limits; (dict "resources" .. "accelerator" ..). */}}
{{- define "specserve.resources" -}}
{{- $resources := deepCopy (default dict .resources) -}}
{{- if .accelerator.resource -}}
{{- $limits := default dict $resources.limits -}}
{{- $_ := set $limits .accelerator.resource (toString (int .accelerator.count)) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* SPECSERVE_<PREFIX>_<FIELD> entries for a ConfigMap from a settings map (field names as in settings.py). */}}
{{- define "specserve.settingsEnv" -}}
{{- range $field, $value := .settings }}
{{ printf "SPECSERVE_%s_%s" $.prefix ($field | upper) }}: {{ include "specserve.envValue" $value | quote }}
{{- end }}
{{- end -}}

{{/* A value as an environment variable's text: whole numbers without an exponent (values are float64 to
     templates, and 2000000 would print as 2e+06), maps and lists as JSON, the rest as they print. */}}
{{- define "specserve.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else if or (kindIs "map" .) (kindIs "slice" .) -}}
{{- toJson . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* The model volume's environment: where registered and hub models are cached. */}}
{{- define "specserve.modelEnv" -}}
- name: SPECSERVE_CACHE_DIR
  value: {{ .Values.modelStorage.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelStorage.mountPath | quote }}
{{- end -}}

{{- define "specserve.modelVolumeMount" -}}
{{- $storage := .Values.modelStorage -}}
- name: models
  mountPath: {{ $storage.mountPath }}
  {{- if and (eq $storage.type "image") (eq $storage.image.method "volume") }}
  subPath: {{ trimPrefix "/" $storage.image.sourcePath }}
  readOnly: true
  {{- else if and (eq $storage.type "pvc") $storage.pvc.readOnly }}
  readOnly: true
  {{- end }}
{{- end -}}

{{- define "specserve.modelClaimName" -}}
{{- default (printf "%s-models" (include "specserve.fullname" .)) .Values.modelStorage.pvc.existingClaim -}}
{{- end -}}

{{- define "specserve.modelVolume" -}}
{{- $storage := .Values.modelStorage -}}
- name: models
{{- if eq $storage.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "specserve.modelClaimName" . }}
    readOnly: {{ $storage.pvc.readOnly }}
{{- else if and (eq $storage.type "image") (eq $storage.image.method "volume") }}
  image:
    reference: {{ include "specserve.image" (dict "root" . "image" $storage.image) }}
    pullPolicy: {{ $storage.image.pullPolicy }}
{{- else }}
  emptyDir:
    {{- with $storage.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* With modelStorage.type image (initContainer): copy the image's model files into the pod's models volume. */}}
{{- define "specserve.modelInitContainers" -}}
{{- $storage := .Values.modelStorage -}}
{{- if and (eq $storage.type "image") (eq $storage.image.method "initContainer") }}
- name: copy-models
  image: {{ include "specserve.image" (dict "root" . "image" $storage.image) }}
  imagePullPolicy: {{ $storage.image.pullPolicy }}
  # The pod's models volume is mounted aside here, so it does not hide the image's own files at sourcePath.
  command: ["sh", "-c", {{ printf "cp -a %s/. /specserve-models/" (trimSuffix "/" $storage.image.sourcePath) | quote }}]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /specserve-models
{{- end }}
{{- end -}}

{{/* Probes on a gRPC port (the services' grpc.health.v1 service); (dict "probes" .. "port" ..). */}}
{{- define "specserve.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc: {port: {{ .port }}}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  grpc: {port: {{ .port }}}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end -}}

{{/* A PodDisruptionBudget; (dict "root" $ "name" .. "selector" <selectorLabels dict> "pdb" ..). */}}
{{- define "specserve.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "specserve.labels" .root | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "specserve.selectorLabels" .selector | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A HorizontalPodAutoscaler for a Deployment; (dict "root" $ "name" .. "autoscaling" ..). */}}
{{- define "specserve.hpa" -}}
{{- if .autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels:
    {{- include "specserve.labels" .root | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ .autoscaling.minReplicas }}
  maxReplicas: {{ .autoscaling.maxReplicas }}
  metrics:
    {{- with .autoscaling.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with .autoscaling.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
{{- end -}}

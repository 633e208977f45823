{{/* The release's base name: the release name, or release-chart when it lacks "fleetllm". */}}
{{- define "fleetllm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fleetllm.operator.name" -}}{{ include "fleetllm.fullname" . }}-operator{{- end -}}
{{- define "fleetllm.router.name" -}}{{ include "fleetllm.fullname" . }}-router{{- end -}}
{{- define "fleetllm.peering" -}}{{ .Values.operator.peering | default (include "fleetllm.fullname" .) }}{{- end -}}

{{/* Labels that select one component's pods; they never change across upgrades. */}}
{{- define "fleetllm.selectorLabels" -}}
app.kubernetes.io/name: fleetllm
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels: the selector labels, the version and the manager. Never
"app.kubernetes.io/managed-by: fleetllm": the operator watches objects with that label. */}}
{{- define "fleetllm.labels" -}}
{{ include "fleetllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: fleetllm
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* An image reference from {registry, repository, tag, digest}; global.imageRegistry
replaces the registry (fleetllm.images.ImageRef does the same). . is a dict: root, image and
tag (the default tag). */}}
{{- define "fleetllm.imageRef" -}}
{{- $registry := .root.Values.global.imageRegistry | default .image.registry -}}
{{- if $registry }}{{ $registry }}/{{ end }}{{ .image.repository }}:{{ .image.tag | default .tag }}
{{- with .image.digest }}@{{ . }}{{ end }}
{{- end -}}

{{- define "fleetllm.image" -}}
{{ include "fleetllm.imageRef" (dict "root" . "image" .Values.image "tag" .Chart.AppVersion) }}
{{- end -}}

{{/* The operator's own images of engine pods, as JSON: its flag name -> the reference. */}}
{{- define "fleetllm.engineImages" -}}
{{- $images := .Values.engine.images -}}
{{- dict
  "engine-image" (include "fleetllm.imageRef" (dict "root" . "image" $images.cpu "tag" .Chart.AppVersion))
  "engine-cuda-image" (include "fleetllm.imageRef" (dict "root" . "image" $images.cuda "tag" (printf "%s-cuda" .Chart.AppVersion)))
  "vllm-image" (include "fleetllm.imageRef" (dict "root" . "image" $images.vllm "tag" ""))
  "vllm-cpu-image" (include "fleetllm.imageRef" (dict "root" . "image" $images.vllmCpu "tag" ""))
  "model-pull-image" (include "fleetllm.imageRef" (dict "root" . "image" $images.modelPull "tag" ""))
  | toJson -}}
{{- end -}}

{{/* The operator's flags for the images and pod settings of engines (operator/cluster_args.py). */}}
{{- define "fleetllm.engineArgs" -}}
{{- $own := include "fleetllm.engineImages" . | fromJson -}}
{{- range $i, $flag := list "engine-image" "engine-cuda-image" "vllm-image" "vllm-cpu-image" "model-pull-image" }}
{{- if $i }}{{ "\n" }}{{ end }}- --{{ $flag }}={{ index $own $flag }}
{{- end }}
{{- range .Values.imagePullSecrets }}
- --image-pull-secret={{ .name }}
{{- end }}
- {{ printf "--engine-pod-settings=%s" (toJson .Values.engine.pod) | quote }}
{{- end -}}

{{/* The restricted Pod Security Standard, for the pod and its container. */}}
{{- define "fleetllm.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "fleetllm.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
{{- end -}}

{{/* Spread a component's replicas over nodes, where the scheduler can. */}}
{{- define "fleetllm.spread" -}}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "fleetllm.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/* Scheduling and pod extras shared by both Deployments; . is the component's values. */}}
{{- define "fleetllm.podScheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The namespaces engines run in, for the NetworkPolicy and the PodMonitor. */}}
{{- define "fleetllm.engineNamespaces" -}}
{{- toJson (.Values.networkPolicy.namespaces | default .Values.watchNamespaces) -}}
{{- end -}}

{{/* A list of globs as a CEL list of anchored regular expressions (raw strings). With
"fold": true, case-insensitive; "tail": a regular expression allowed after the name. */}}
{{- define "fleetllm.celGlobs" -}}
{{- $fold := .fold -}}
{{- $tail := .tail | default "" -}}
[{{- range $i, $glob := .globs }}{{ if $i }}, {{ end }}r'{{ if $fold }}(?i){{ end }}^{{ $glob | regexQuoteMeta | replace "\\*" ".*" | replace "\\?" "." }}{{ $tail }}$'{{- end }}]
{{- end -}}

{{/* The Secret of the fleet's root secret (engineKeys). */}}
{{- define "fleetllm.engineKeys.name" -}}
{{ .Values.engineKeys.secretName | default (printf "%s-engine-keys" (include "fleetllm.fullname" .)) }}
{{- end -}}

{{/* The env of the operator and router containers that holds it: both derive each
LLMDeployment's engine key from it (fleetllm.api.contract.engine_key). */}}
{{- define "fleetllm.engineKeys.env" -}}
- name: FLEETLLM_ENGINE_KEY_ROOT
  valueFrom:
    secretKeyRef:
      name: {{ include "fleetllm.engineKeys.name" . }}
      key: root
{{- end -}}

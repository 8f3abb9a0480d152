{{/* Names and labels. */}}
{{- define "kvidx.fullname" -}}
{{- printf "%s-kvidx" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvidx.labels" -}}
app.kubernetes.io/name: kvidx
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvidx.selector" -}}
app.kubernetes.io/name: kvidx
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The largest replica group count of any model. */}}
{{- define "kvidx.maxGroups" -}}
{{- $max := 1 -}}
{{- range .Values.config.models -}}
{{- if gt (int (default 1 .replicaGroups)) $max -}}{{- $max = int .replicaGroups -}}{{- end -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* Checks: every model's groups fit the partitions (a model's groups go to distinct partitions),
and the service sets together hold every group. */}}
{{- define "kvidx.check" -}}
{{- $max := int (include "kvidx.maxGroups" .) -}}
{{- range .Values.config.models -}}
{{- if gt (int (default 1 .replicaGroups)) (int $.Values.kafka.partitions) -}}
{{- fail (printf "model %s: replicaGroups %v is more than kafka.partitions %v (a model's groups go to distinct partitions)" .name .replicaGroups $.Values.kafka.partitions) -}}
{{- end -}}
{{- end -}}
{{- $held := dict -}}
{{- range .Values.service.sets -}}
{{- if not .groups -}}
{{- range $g := until $max -}}{{- $_ := set $held (toString $g) true -}}{{- end -}}
{{- else -}}
{{- range $g := splitList "," (toString .groups) -}}
{{- if ge (int (trim $g)) $max -}}
{{- fail (printf "service set %s holds group %s, but no model has more than %d groups" $.name (trim $g) $max) -}}
{{- end -}}
{{- $_ := set $held (trim $g) true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $g := until $max -}}
{{- if not (hasKey $held (toString $g)) -}}
{{- fail (printf "no service set holds replica group %d: lookups would be partial" $g) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What every kvidx container shares: the broker, the config file, the Kafka client settings. */}}
{{- define "kvidx.env" -}}
- name: KAFKA_BOOTSTRAP_SERVERS
  value: {{ .Values.kafka.bootstrap | quote }}
- name: KVIDX_TOPIC_PREFIX
  value: {{ .Values.kafka.topicPrefix | quote }}
- name: KVIDX_TOPIC_PARTITIONS
  value: {{ .Values.kafka.partitions | quote }}
{{- if .Values.kafka.replicationFactor }}
- name: KVIDX_TOPIC_REPLICATION
  value: {{ .Values.kafka.replicationFactor | quote }}
{{- end }}
{{- if .Values.kafka.minInsyncReplicas }}
- name: KVIDX_MIN_INSYNC_REPLICAS
  value: {{ .Values.kafka.minInsyncReplicas | quote }}
{{- end }}
{{- if .Values.kafka.clientConfig }}
- name: KVIDX_KAFKA_CONFIG
  value: /etc/kvidx/kafka-client.json
{{- end }}
{{- end -}}

{{- define "kvidx.volumeMount" -}}
- name: config
  mountPath: /etc/kvidx
  readOnly: true
{{- end -}}

{{- define "kvidx.volume" -}}
- name: config
  configMap:
    name: {{ include "kvidx.fullname" . }}
{{- end -}}

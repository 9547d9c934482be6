#!/usr/bin/env bash
# Launch `jopd train CONFIG` on every worker of a TPU slice, with the same command line everywhere.
set -euo pipefail
USAGE="run.sh NAME ZONE CONFIG [key=value ...]
  NAME, ZONE  the TPU slice (see create.sh, then setup.sh)
  CONFIG      run config, relative to the repo on the workers, e.g. configs/qwen3_1p7b_from_8b_v5e.yaml
  key=value   config overrides, e.g. student.path=gs://bucket/qwen3-1.7b checkpoint.dir=gs://bucket/run1
Every worker runs the same command; JAX finds the other workers from the TPU metadata (no coordinator
arguments). The run is detached (nohup): follow it with
  gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=0 --command 'tail -f ~/jopd-train.log'
It resumes from the latest checkpoint in checkpoint.dir if there is one.
env: PROJECT, DRY_RUN=1 (print the gcloud commands only)"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[ "$#" -ge 3 ] || usage "missing arguments"
NAME="$1"; ZONE="$2"; CONFIG="$3"; shift 3
check_name "${NAME}"
check_zone "${ZONE}"
[[ "${CONFIG}" == *.yaml || "${CONFIG}" == *.yml ]] || usage "CONFIG '${CONFIG}': expected a .yaml run config"
for kv in "$@"; do
  [[ "${kv}" == *=* ]] || usage "override '${kv}': expected key=value"
done
need_gcloud
gcloud_scope "${ZONE}"

# JOPD_DISTRIBUTED=on: every worker joins one jax.distributed job (JAX reads the worker list from the TPU
# metadata server); it also runs JAX's preemption service, so all workers checkpoint the same step.
cmd="env JOPD_DISTRIBUTED=on \$HOME/jopd-venv/bin/jopd train $(printf '%q ' "${CONFIG}" "$@")"
echo "launching on every worker of ${NAME}: ${cmd}" >&2
run gcloud compute tpus tpu-vm ssh "${NAME}" "${SCOPE[@]}" --worker=all --command \
  "cd ~/jopd && if pgrep -f '[j]opd-venv/bin/jopd train' >/dev/null; then echo \"a jopd run is already running on \$(hostname) (tpu_scripts/stop.sh stops it)\"; exit 1; fi; \
nohup setsid ${cmd} > ~/jopd-train.log 2>&1 < /dev/null & sleep 1; echo \"started on \$(hostname)\""
echo "follow: gcloud compute tpus tpu-vm ssh ${NAME} --zone ${ZONE} --worker=0 --command 'tail -f ~/jopd-train.log'" >&2

#!/usr/bin/env bash
# Request a Cloud TPU slice (a queued resource by default) and wait until it is ACTIVE.
set -euo pipefail
USAGE="create.sh NAME ZONE ACCELERATOR_TYPE RUNTIME_VERSION [--spot] [--tpu-vm] [--no-wait]
  NAME              TPU name (also the queued-resource id), e.g. jopd-v5e
  ZONE              e.g. us-west4-a (v5e), us-east5-a (v5p), us-east1-d (v6e)
  ACCELERATOR_TYPE  e.g. v5litepod-16 (16 v5e chips), v5p-16 (8 v5p chips), v4-32, v6e-16
  RUNTIME_VERSION   TPU VM image: v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv5 (v5p), tpu-ubuntu2204-base (v4),
                    v2-alpha-tpuv6e (v6e)
  --spot            Spot capacity: cheaper, can be preempted at any time (the run resumes from its checkpoint)
  --tpu-vm          create the TPU VM directly (gcloud compute tpus tpu-vm create), not a queued resource
  --no-wait         return once the request is made
env: PROJECT (default: gcloud's configured project), DRY_RUN=1 (print the gcloud commands only)"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[ "$#" -ge 4 ] || usage "missing arguments"
NAME="$1"; ZONE="$2"; ACCEL="$3"; RUNTIME="$4"; shift 4
SPOT=0; TPU_VM=0; WAIT=1
for flag in "$@"; do
  case "${flag}" in
    --spot) SPOT=1 ;;
    --tpu-vm) TPU_VM=1 ;;
    --no-wait) WAIT=0 ;;
    *) usage "unknown option '${flag}'" ;;
  esac
done
check_name "${NAME}"
check_zone "${ZONE}"
[[ "${ACCEL}" =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]] || usage "ACCELERATOR_TYPE '${ACCEL}': expected e.g. v5litepod-16, v5p-16, v4-32"
[[ "${RUNTIME}" =~ ^[a-z0-9][-a-z0-9.]*$ ]] || usage "RUNTIME_VERSION '${RUNTIME}': expected e.g. v2-alpha-tpuv5-lite"
need_gcloud
gcloud_scope "${ZONE}"

CAPACITY=$([ "${SPOT}" = 1 ] && echo "spot" || echo "on-demand")
if [ "${TPU_VM}" = 1 ]; then
  echo "creating TPU VM ${NAME}: ${ACCEL}, ${RUNTIME}, ${CAPACITY}, in ${ZONE}" >&2
  args=(compute tpus tpu-vm create "${NAME}" "${SCOPE[@]}" --accelerator-type "${ACCEL}" --version "${RUNTIME}")
  if [ "${SPOT}" = 1 ]; then args+=(--spot); fi
  run gcloud "${args[@]}"
  exit 0
fi

echo "requesting queued resource ${NAME}: ${ACCEL}, ${RUNTIME}, ${CAPACITY}, in ${ZONE}" >&2
args=(compute tpus queued-resources create "${NAME}" --node-id "${NAME}" "${SCOPE[@]}"
      --accelerator-type "${ACCEL}" --runtime-version "${RUNTIME}")
if [ "${SPOT}" = 1 ]; then args+=(--spot); fi
run gcloud "${args[@]}"
if [ "${WAIT}" = 0 ] || [ "${DRY_RUN:-0}" = 1 ]; then exit 0; fi

echo "waiting for ${NAME} to become ACTIVE (Ctrl-C stops waiting, not the request)" >&2
while true; do
  state=$(gcloud compute tpus queued-resources describe "${NAME}" "${SCOPE[@]}" --format='value(state.state)')
  echo "$(date +%H:%M:%S) ${NAME}: ${state}" >&2
  case "${state}" in
    ACTIVE) break ;;
    FAILED|SUSPENDED) echo "error: queued resource ${NAME} is ${state}; see: gcloud compute tpus queued-resources describe ${NAME} --zone ${ZONE}" >&2; exit 1 ;;
  esac
  sleep 30
done
echo "ready: next, tpu_scripts/setup.sh ${NAME} ${ZONE}" >&2

#!/usr/bin/env bash
# Delete a TPU slice: its queued resource and node (or a TPU VM made with create.sh --tpu-vm).
set -euo pipefail
USAGE="teardown.sh NAME ZONE
  NAME, ZONE  the TPU slice (see create.sh). Checkpoints in gs:// are kept; local disks are deleted.
env: PROJECT, DRY_RUN=1 (print the gcloud commands only)"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

slice_args "$@"

if [ "${DRY_RUN:-0}" = 1 ] || gcloud compute tpus queued-resources describe "${NAME}" "${SCOPE[@]}" >/dev/null 2>&1; then
  echo "deleting queued resource ${NAME} and its TPU node in ${ZONE}" >&2
  run gcloud compute tpus queued-resources delete "${NAME}" "${SCOPE[@]}" --force --quiet
else
  echo "no queued resource ${NAME}: deleting TPU VM ${NAME} in ${ZONE}" >&2
  run gcloud compute tpus tpu-vm delete "${NAME}" "${SCOPE[@]}" --quiet
fi

#!/usr/bin/env bash
# Stop a run gracefully: SIGTERM to `jopd train` on every worker, as a preemption notice would. The trainer
# finishes its step, saves a checkpoint (all workers at the same step) and exits; run.sh resumes it.
set -euo pipefail
USAGE="stop.sh NAME ZONE
  NAME, ZONE  the TPU slice running the job (see run.sh)
env: PROJECT, DRY_RUN=1 (print the gcloud commands only)"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

slice_args "$@"

echo "sending SIGTERM to jopd train on every worker of ${NAME}" >&2
run gcloud compute tpus tpu-vm ssh "${NAME}" "${SCOPE[@]}" --worker=all --command \
  "pkill -TERM -f '[j]opd-venv/bin/jopd train' && echo \"SIGTERM sent on \$(hostname)\" || echo \"no run on \$(hostname)\""

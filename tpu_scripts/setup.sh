#!/usr/bin/env bash
# Put jopd on every worker of a TPU slice and install it with the TPU extra (jax[tpu]) in ~/jopd-venv.
set -euo pipefail
USAGE="setup.sh NAME ZONE [REPO] [--data DIR]
  NAME, ZONE  the TPU slice (see create.sh)
  REPO        a git URL to clone on every worker, or a local checkout to copy (its committed HEAD, via
              git archive); default: the checkout holding this script
  --data DIR  also copy a local data directory (e.g. GSM8K JSONL files) to ~/jopd/data/ on every worker
env: PROJECT, DRY_RUN=1 (print the gcloud commands only), PYTHON (worker interpreter, default python3.11)"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[ "$#" -ge 2 ] || usage "missing arguments"
NAME="$1"; ZONE="$2"; shift 2
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --data) [ "$#" -ge 2 ] || usage "--data needs a directory"; DATA="$2"; shift 2 ;;
    -*) usage "unknown option '$1'" ;;
    *) REPO="$1"; shift ;;
  esac
done
check_name "${NAME}"
check_zone "${ZONE}"
if [ -n "${DATA}" ] && [ ! -d "${DATA}" ]; then usage "--data ${DATA}: not a directory"; fi
need_gcloud
gcloud_scope "${ZONE}"
PY="${PYTHON:-python3.11}"
ssh_all() { run gcloud compute tpus tpu-vm ssh "${NAME}" "${SCOPE[@]}" --worker=all --command "$1"; }

if [[ "${REPO}" =~ ^(https://|http://|git@|ssh://) ]]; then
  echo "cloning ${REPO} into ~/jopd on every worker of ${NAME}" >&2
  ssh_all "rm -rf ~/jopd && git clone --depth 1 $(printf '%q' "${REPO}") ~/jopd"
else
  [ -d "${REPO}/.git" ] || [ -f "${REPO}/.git" ] || usage "REPO ${REPO}: not a git checkout or URL"
  if [ -n "$(git -C "${REPO}" status --porcelain --untracked-files=no)" ]; then
    echo "warning: ${REPO} has uncommitted changes; only the committed HEAD is copied" >&2
  fi
  tmp_dir="$(mktemp -d)"
  trap 'rm -rf "${tmp_dir}"' EXIT
  archive="${tmp_dir}/jopd.tar.gz"
  echo "copying ${REPO} (HEAD $(git -C "${REPO}" rev-parse --short HEAD)) to ~/jopd on every worker of ${NAME}" >&2
  run git -C "${REPO}" archive --format=tar.gz -o "${archive}" HEAD
  run gcloud compute tpus tpu-vm scp "${archive}" "${NAME}:~/jopd.tar.gz" "${SCOPE[@]}" --worker=all
  ssh_all "rm -rf ~/jopd && mkdir -p ~/jopd && tar -xzf ~/jopd.tar.gz -C ~/jopd"
fi
if [ -n "${DATA}" ]; then
  echo "copying ${DATA} to ~/jopd/data/ on every worker" >&2
  run gcloud compute tpus tpu-vm scp --recurse "${DATA}" "${NAME}:~/jopd/data/" "${SCOPE[@]}" --worker=all
fi

echo "installing jopd[tpu] (and gcsfs, for gs:// checkpoints) into ~/jopd-venv with ${PY} on every worker" >&2
ssh_all "set -e; if ! command -v ${PY} >/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq ${PY} ${PY}-venv; fi; \
${PY} -m venv ~/jopd-venv && ~/jopd-venv/bin/pip install -q -U pip && \
~/jopd-venv/bin/pip install -q -e \"\$HOME/jopd[tpu]\" gcsfs && \
~/jopd-venv/bin/python -c 'import jax; print(\"worker ok:\", jax.local_device_count(), \"local devices\", jax.local_devices()[0].device_kind)'"
echo "ready: next, tpu_scripts/run.sh ${NAME} ${ZONE} CONFIG [key=value ...]" >&2

# Shared helpers of the tpu_scripts (sourced, not run). Each script sets USAGE before sourcing this file.
# DRY_RUN=1 prints every gcloud command instead of running it.

usage() {
  echo "usage: ${USAGE}" >&2
  if [ -n "${1:-}" ]; then echo "error: $1" >&2; fi
  exit 2
}

# Print a command (shell-quoted), then run it unless DRY_RUN=1.
run() {
  echo "+ $(printf '%q ' "$@")" >&2
  if [ "${DRY_RUN:-0}" = "1" ]; then return 0; fi
  "$@"
}

need_gcloud() {
  if [ "${DRY_RUN:-0}" != "1" ] && ! command -v gcloud >/dev/null 2>&1; then
    echo "error: gcloud not found; install the Google Cloud CLI (https://cloud.google.com/sdk)" >&2
    exit 1
  fi
}

check_name() {  # TPU / queued-resource names: lowercase letters, digits, hyphens; start with a letter
  [[ "$1" =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] || usage "NAME '$1': use lowercase letters, digits and '-', starting with a letter"
}

check_zone() {
  [[ "$1" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || usage "ZONE '$1': expected a zone such as us-west4-a or us-east5-a"
}

# gcloud flags every script passes: the zone, and the project when PROJECT is set (else gcloud's default).
gcloud_scope() {
  SCOPE=(--zone "$1")
  if [ -n "${PROJECT:-}" ]; then SCOPE+=(--project "${PROJECT}"); fi
}

slice_args() {  # the NAME ZONE arguments of stop.sh / teardown.sh: checked, gcloud found, scope set
  [ "$#" -eq 2 ] || usage "expected NAME ZONE"
  NAME="$1"; ZONE="$2"
  check_name "${NAME}"
  check_zone "${ZONE}"
  need_gcloud
  gcloud_scope "${ZONE}"
}

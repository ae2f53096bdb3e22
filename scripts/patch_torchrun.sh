#!/usr/bin/env bash
# Adds (apply) or removes (revert) `import mindspeed_tft.torchrun_adaptor` in the installed torchrun
# script, the reference SDK's documented way of enabling worker reboot under plain torchrun:
# with it, torchrun restarts only failed workers when the training command turns worker reboot
# on (--enable-high-availability --enable-worker-reboot, or HIGH_AVAILABILITY=recover), and
# behaves exactly as before otherwise. Both directions are idempotent.
#
#   scripts/patch_torchrun.sh [apply|revert|status]      (default: apply)
#
# Target: $TORCHRUN if set, else `command -v torchrun`. Needs GNU patch.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PATCH_FILE="${ROOT}/patches/torchrun.patch"
MARKER="import mindspeed_tft.torchrun_adaptor"

die() { echo "patch_torchrun: error: $*" >&2; exit 2; }

action="${1:-apply}"
case "${action}" in
    apply|revert|status) ;;
    *) die "unknown action '${action}'; allowed: apply, revert, status" ;;
esac
target="${TORCHRUN:-$(command -v torchrun || true)}"
[ -n "${target}" ] || die "torchrun is not on PATH; set TORCHRUN=/path/to/torchrun"
[ -f "${target}" ] || die "TORCHRUN=${target}: no such file"
command -v patch >/dev/null || die "GNU patch is needed (e.g. apt-get install patch)"

applied() { grep -q "^${MARKER}\b" "${target}"; }

case "${action}" in
status)
    if applied; then echo "patched: ${target}"; else echo "not patched: ${target}"; fi
    ;;
apply)
    if applied; then
        echo "already patched: ${target}"
        exit 0
    fi
    patch --dry-run --silent --forward "${target}" < "${PATCH_FILE}" >/dev/null 2>&1 \
        || die "${target} does not look like the torchrun script pip installs (expected the" \
               "lines 'import sys' and 'from torch.distributed.run import main'); add the" \
               "line '${MARKER}' after 'import sys' by hand"
    patch --silent --forward --no-backup-if-mismatch --reject-file=- "${target}" < "${PATCH_FILE}"
    echo "patched: ${target}"
    ;;
revert)
    if ! applied; then
        echo "not patched: ${target}"
        exit 0
    fi
    patch --dry-run --silent --reverse "${target}" < "${PATCH_FILE}" >/dev/null 2>&1 \
        || die "${target} was changed since it was patched; remove the line '${MARKER}...'" \
               "by hand"
    patch --silent --reverse --no-backup-if-mismatch --reject-file=- "${target}" < "${PATCH_FILE}"
    echo "reverted: ${target}"
    ;;
esac

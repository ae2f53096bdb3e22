#!/usr/bin/env bash
# Finds (or fetches) the two Megatron-LM clones the tests run against and exports them:
#   MEGATRON_LM      Megatron-LM core_v0.12.1 (the version the MindIO TFT guide pairs with)
#   MEGATRON_LM_016  Megatron-LM core_v0.16.1 (the second supported version)
# Sourced by scripts/test.sh; run it directly to print the two paths.
#
# Each is looked for, in order: the environment variable; shared/<name> beside the checkout
# (shared/megatron-lm, shared/megatron-lm-0.16.1); the cache outside the checkout
# (${XDG_CACHE_HOME:-~/.cache}/mindspeed-tft/megatron-lm-<tag>); else it is cloned into that
# cache (`git clone --depth 1 --branch <tag>`). When none of this works it stops with one line
# saying which variable to set. The clones are read, never edited: the tests copy them.
# TFT_MEGATRON_LM_URL replaces the repository cloned from (a mirror; the tests use a local one),
# TFT_CLONE_TIMEOUT the clone's time limit in seconds (default 900).

_tft_mlm_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_tft_mlm_cache="${XDG_CACHE_HOME:-${HOME}/.cache}/mindspeed-tft"
_tft_mlm_url="${TFT_MEGATRON_LM_URL:-https://github.com/NVIDIA/Megatron-LM.git}"

# _tft_mlm_find VAR TAG SHARED_NAME: sets VAR to a clone of TAG, or prints one line and fails
_tft_mlm_find() {
    local var="$1" tag="$2" shared="$3" given path tmp
    given="${!var:-}"
    if [ -n "${given}" ]; then
        if [ -f "${given}/pretrain_gpt.py" ] && [ -d "${given}/megatron/core" ]; then
            export "${var}=${given}"
            return 0
        fi
        echo "${var}=${given} is not a Megatron-LM clone (no pretrain_gpt.py, megatron/core):" \
            "set ${var} to a clone of Megatron-LM ${tag}" >&2
        return 1
    fi
    for path in "${_tft_mlm_root}/../shared/${shared}" "${_tft_mlm_cache}/megatron-lm-${tag}"; do
        if [ -f "${path}/pretrain_gpt.py" ] && [ -d "${path}/megatron/core" ]; then
            export "${var}=$(cd "${path}" && pwd)"
            return 0
        fi
    done
    path="${_tft_mlm_cache}/megatron-lm-${tag}"
    tmp="${path}.partial.$$"
    if mkdir -p "${_tft_mlm_cache}" 2>/dev/null \
        && GIT_TERMINAL_PROMPT=0 timeout "${TFT_CLONE_TIMEOUT:-900}" \
            git clone -q --depth 1 --branch "${tag}" "${_tft_mlm_url}" "${tmp}" >/dev/null 2>&1 \
        && mv "${tmp}" "${path}"; then
        echo "[megatron] cloned Megatron-LM ${tag} into ${path}" >&2
        export "${var}=${path}"
        return 0
    fi
    rm -rf "${tmp}"
    echo "Megatron-LM ${tag} not found and \`git clone\` of it failed:" \
        "set ${var}=/path/to/a Megatron-LM ${tag} clone (git clone --depth 1 --branch ${tag} ${_tft_mlm_url})" >&2
    return 1
}

_tft_mlm_find MEGATRON_LM core_v0.12.1 megatron-lm \
    && _tft_mlm_find MEGATRON_LM_016 core_v0.16.1 megatron-lm-0.16.1
_tft_mlm_rc=$?
unset -f _tft_mlm_find
unset _tft_mlm_root _tft_mlm_cache _tft_mlm_url

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    # run, not sourced: print what was found
    [ "${_tft_mlm_rc}" -eq 0 ] || exit "${_tft_mlm_rc}"
    echo "MEGATRON_LM=${MEGATRON_LM}"
    echo "MEGATRON_LM_016=${MEGATRON_LM_016}"
    exit 0
fi
# shellcheck disable=SC2317
return "${_tft_mlm_rc}"

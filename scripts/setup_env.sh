#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and activates it.
# Sourced by scripts/demo.sh and scripts/test.sh. Idempotent: when .venv exists and the
# package metadata has not changed since the last install, it only activates the venv.
#
# The CPU wheel of torch is pinned here: an unpinned torch would pull a multi-GB CUDA build.
# On GPU or NPU machines, install torch (and torch_npu) yourself before `pip install -e .`.
# pybind11 (in the test extra) lets Megatron-LM compile its dataset helpers at start-up.
# sdk/ (the `mindio_ttp` package for MindSpeed-LLM) is installed beside the project.

TFT_TORCH_VERSION="${TFT_TORCH_VERSION:-2.13.0}"
_tft_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_tft_venv="${TFT_VENV:-${_tft_root}/.venv}"
_tft_stamp="${_tft_venv}/.tft-installed"
_tft_want="torch==${TFT_TORCH_VERSION} $(cat "${_tft_root}/setup.cfg" "${_tft_root}/pyproject.toml" "${_tft_root}/sdk/setup.cfg" | sha256sum | cut -c1-16)"

if [ ! -x "${_tft_venv}/bin/python" ]; then
    echo "[setup] creating ${_tft_venv}"
    python3 -m venv "${_tft_venv}" || return 1 2>/dev/null || exit 1
fi
# shellcheck disable=SC1091
source "${_tft_venv}/bin/activate"

# uv (from PyPI, into the venv) installs the same packages as pip about three times faster
# (parallel downloads and bytecode compilation); pip does it where uv cannot
_tft_uv_install() {
    python -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || return 1
    local links=()  # where pip is told to look, uv looks too (uv reads no PIP_* variable)
    [ -n "${PIP_FIND_LINKS:-}" ] && links+=(--find-links "${PIP_FIND_LINKS}")
    [ -n "${PIP_INDEX_URL:-}" ] && links+=(--index-url "${PIP_INDEX_URL}")
    [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && links+=(--extra-index-url "${PIP_EXTRA_INDEX_URL}")
    python -m uv pip install -q --python "$(command -v python)" --compile-bytecode ${links[@]+"${links[@]}"} \
        "torch==${TFT_TORCH_VERSION}" -e "${_tft_root}[test]" || return 1
    python -m uv pip install -q --python "$(command -v python)" --no-deps -e "${_tft_root}/sdk"
}

_tft_pip_install() {
    python -m pip install -q --disable-pip-version-check "torch==${TFT_TORCH_VERSION}" \
        || { echo "[setup] pip install torch failed" >&2; return 1; }
    python -m pip install -q --disable-pip-version-check -e "${_tft_root}[test]" \
        || { echo "[setup] pip install -e . failed" >&2; return 1; }
    # the `mindio_ttp` API on this control plane (sdk/, a distribution of its own: README.md)
    python -m pip install -q --disable-pip-version-check --no-deps -e "${_tft_root}/sdk" \
        || { echo "[setup] pip install -e sdk failed" >&2; return 1; }
}

if [ ! -f "${_tft_stamp}" ] || [ "$(cat "${_tft_stamp}")" != "${_tft_want}" ]; then
    echo "[setup] installing torch==${TFT_TORCH_VERSION} (CPU) and mindspeed-tft with its dependencies"
    if ! _tft_uv_install; then
        echo "[setup] uv could not install them; pip does"
        _tft_pip_install || return 1 2>/dev/null || exit 1
    fi
    echo "${_tft_want}" > "${_tft_stamp}"
fi
unset -f _tft_uv_install _tft_pip_install
unset _tft_root _tft_venv _tft_stamp _tft_want

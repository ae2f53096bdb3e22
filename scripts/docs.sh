#!/usr/bin/env bash
# Builds the API reference (docs/api/, Sphinx with autodoc and napoleon) into
# docs/_build/html, warnings as errors. Installs the `docs` extra of setup.cfg into the
# project's venv when Sphinx is missing. Run by scripts/test.sh before pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
if ! python -c "import sphinx" 2>/dev/null; then
    echo "[docs] installing the docs extra (Sphinx)"
    mapfile -t _reqs < <(python - <<'PY'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
print("\n".join(r.strip() for r in cfg["options.extras_require"]["docs"].splitlines() if r.strip()))
PY
)
    python -m pip install -q --disable-pip-version-check "${_reqs[@]}"
fi
python -m sphinx -W --keep-going -q -b html -d docs/_build/doctrees docs/api docs/_build/html
echo "[docs] docs/_build/html/index.html"

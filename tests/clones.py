"""Where the tests find the Megatron-LM clones, one per pinned megatron-core version.

Each clone is unmodified Megatron-LM at a tag (read-only; a test that runs it works on a
copy): core_v0.12.1 from ``$MEGATRON_LM``, core_v0.16.1 from ``$MEGATRON_LM_016``, else
``shared/megatron-lm`` and ``shared/megatron-lm-0.16.1`` beside the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: megatron-core version -> (environment variable, folder name under shared/)
CLONES = {
    "0.12.1": ("MEGATRON_LM", "megatron-lm"),
    "0.16.1": ("MEGATRON_LM_016", "megatron-lm-0.16.1"),
}
VERSIONS = tuple(CLONES)


def clone_path(version: str) -> Path:
    """Where the clone of `version` is looked for."""
    variable, folder = CLONES[version]
    return Path(os.environ.get(variable) or REPO.parent / "shared" / folder)


def clone(version: str) -> Path | str:
    """The Megatron-LM clone of megatron-core `version`, or why there is none (one line)."""
    path = clone_path(version)
    if not (path / "megatron" / "training" / "__init__.py").is_file():
        variable, _ = CLONES[version]
        return (f"Megatron-LM core_v{version} not found at {path} (no megatron/training): "
                f"clone it there or set {variable} to a clone")
    return path

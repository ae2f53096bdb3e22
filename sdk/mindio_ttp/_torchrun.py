"""The usage guide's step: `import mindio_ttp.framework_ttp` at the top of the installed
`torchrun` script. In that program (and only there) the import installs the ``torchrun``
moment of `mindspeed_tft.patches`, as `import mindspeed_tft.torchrun_adaptor` does: torchrun's
launches whose training command turns high availability on go through mindspeed-tft's
launcher (the controller in the launcher, and with worker reboot only failed workers
restarted); the others run exactly as before. In a training process the import does nothing
of the kind.
"""

from __future__ import annotations

import os
import sys


def importing_program_is_torchrun() -> bool:
    """Whether this process runs the `torchrun` console script."""
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "torchrun"


def install_if_torchrun() -> bool:
    """Install the torchrun moment when imported by torchrun; True if this call did."""
    if not importing_program_is_torchrun():
        return False
    from mindspeed_tft import patches

    return patches.install("torchrun")

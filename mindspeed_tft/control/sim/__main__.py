"""`python -m mindspeed_tft.control.sim`: the same as `tft-sim`."""

import sys

from .cli import main

sys.exit(main())

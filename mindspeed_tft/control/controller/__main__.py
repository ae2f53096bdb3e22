"""`python -m mindspeed_tft.control.controller`: a standalone controller (see `controller.main`)."""

import sys

from .controller import main

sys.exit(main())

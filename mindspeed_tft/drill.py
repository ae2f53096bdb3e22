"""``python -m mindspeed_tft.drill``: ``tft-drill`` under the name users' commands have.

The tool lives in `mindspeed_tft.tools.drill`; importing this module gives that module.
"""

import sys

from mindspeed_tft.tools import drill

if __name__ == "__main__":
    sys.exit(drill.main())
sys.modules[__name__] = drill

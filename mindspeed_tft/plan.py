"""``python -m mindspeed_tft.plan``: ``tft-plan`` under the name users' commands have.

The tool lives in `mindspeed_tft.tools.plan`; importing this module gives that module.
"""

import sys

from mindspeed_tft.tools import plan

if __name__ == "__main__":
    sys.exit(plan.main())
sys.modules[__name__] = plan

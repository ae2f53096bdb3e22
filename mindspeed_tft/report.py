"""``python -m mindspeed_tft.report``: ``tft-report`` under the name users' commands have.

The tool lives in `mindspeed_tft.tools.report`; importing this module gives that module.
"""

import sys

from mindspeed_tft.tools import report

if __name__ == "__main__":
    sys.exit(report.main())
sys.modules[__name__] = report

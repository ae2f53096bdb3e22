"""``python -m mindspeed_tft.control.keys DIR``: the key tool under the name users' commands
and manifests have (a stable command; the module lives in `mindspeed_tft.control.wire.keys`,
and importing this module gives that module)."""

import sys

from mindspeed_tft.control.wire import keys

if __name__ == "__main__":
    sys.exit(keys.main())
sys.modules[__name__] = keys

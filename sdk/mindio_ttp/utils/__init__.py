"""Update times for the UCE decision, as in the SDK's `mindio_ttp.utils`.

Modules:

- `uce_utils`: when the last optimizer update started and ended, for the UCE decision
"""

from .uce_utils import tft_can_do_uce_repair, tft_set_update_end_time, tft_set_update_start_time

__all__ = ["tft_can_do_uce_repair", "tft_set_update_end_time", "tft_set_update_start_time"]

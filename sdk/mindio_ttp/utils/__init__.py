"""Update times for the UCE decision, as in the SDK's `mindio_ttp.utils`."""

from .uce_utils import tft_can_do_uce_repair, tft_set_update_end_time, tft_set_update_start_time

__all__ = ["tft_can_do_uce_repair", "tft_set_update_end_time", "tft_set_update_start_time"]

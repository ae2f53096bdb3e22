"""One rank (world size 1) on this project's `mindio_ttp`: the operator pauses the controller
after iteration 2 and resumes it 1 s later; prints, as JSON, how long each `tft_pause_train`
call blocked and what `tft_is_reboot_node` answered twice. `tests/test_sdk_units.py` reads it.

    pause_probe.py PORT
"""

import json
import sys
import threading
import time

import mindio_ttp.framework_ttp as ft
from mindio_ttp._runtime import RUNTIME

port = int(sys.argv[1])
ft.tft_init_controller(0, 1, False)
ft.tft_start_controller("127.0.0.1", port, False, "")
ft.tft_init_processor(0, 1, False, False, "", True, False)
ft.tft_start_processor("127.0.0.1", port)
reboot = [ft.tft_is_reboot_node(), ft.tft_is_reboot_node()]
ft.tft_set_optimizer_replica(0, [{"rank_list": [0], "replica_cnt": 1, "replica_shift": 0}])
reached = threading.Event()


def operator() -> None:
    reached.wait(30)
    RUNTIME.controller.pause()
    time.sleep(1.0)
    RUNTIME.controller.resume()


threading.Thread(target=operator, daemon=True).start()
blocked = {}
for iteration in range(6):
    ft.tft_start_updating_os()
    ft.tft_end_updating_os(iteration + 1)
    if iteration + 1 == 2:
        reached.set()
        time.sleep(0.3)  # the pause order arrives
    start = time.monotonic()
    ft.tft_pause_train(iteration + 1)
    blocked[iteration + 1] = round(time.monotonic() - start, 3)
ft.tft_destroy_processor()
ft.tft_destroy_controller()
print(json.dumps({"blocked": blocked, "reboot": reboot}), flush=True)

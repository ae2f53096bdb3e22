"""Calls `mindio_ttp.framework_ttp` functions in order and prints, per call, one JSON line
of what came of it: `{"ok": true}` or `{"error": <type>, "message": <text>, "exception":
<is it an Exception>}`. A call that ends the process (the SDK's refusals that exit with 2)
prints nothing: the caller reads the exit code. `tests/test_sdk_compat.py` runs it under
both SDKs with the same calls.

    refusal_probe.py '[["tft_init_controller", [-1, 4, false]], ...]'
"""

import json
import os
import sys

os.environ.setdefault("MINDIO_FOR_MINDSPORE", "1")  # Huawei's SDK: its CPU code path

import mindio_ttp.framework_ttp as ft  # noqa: E402

for name, args in json.loads(sys.argv[1]):
    try:
        getattr(ft, name)(*args)
    except Exception as e:  # noqa: BLE001  # what the SDK raises is what is compared
        print(json.dumps({"error": type(e).__name__, "message": str(e),
                          "exception": isinstance(e, Exception)}), flush=True)
    else:
        print(json.dumps({"ok": True}), flush=True)
os._exit(0)  # Huawei's SDK: no teardown of its threads

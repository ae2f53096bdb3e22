"""The user tools, each a console script (setup.cfg) and a ``python -m`` module.

``python -m mindspeed_tft.report`` (``drill``, ``plan``) keeps working: those modules at the
package root are thin aliases of these. The plugin never imports this package; the
goodput analysis the control plane shares with `report` is `mindspeed_tft.goodput`.

Modules:

- `report`: ``tft-report``: what happened in a job, from its events file, and its goodput
- `timeline`: the recovery timeline as a picture (``tft-report --plot``)
- `drill`: ``tft-drill``: prove that a launch command recovers from faults before a long run
- `plan`: ``tft-plan``: how many optimizer replicas fit on the device, and what they buy
- `testbed`: ``tft-testbed``: hosts with network stacks of their own on one machine (root)
"""

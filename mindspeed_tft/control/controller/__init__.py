"""The controller side: the `controller.Controller` (one loop thread), the incident flow
(`incident`), the strategy and its plans (`strategy`), backup controllers (`backup`), the
metrics endpoint (`metrics`), the rank table (`ranktable`), the state machine (`states`),
elastic shrink / grow decisions (`elasticity`) and connection admission (`admission`).
Imports `wire/`, never `processor/`. Standalone: `python -m mindspeed_tft.control.controller`."""

"""The events stream's vocabulary without I/O: the controller's rank in a record, and the
check of an iteration record (`validate_record`, the Stable API's; `events` re-exports it).

The control plane's cores build event records with these and never write one: `events`
(which writes the file) and every reader share them.
"""

from __future__ import annotations

from typing import Any

#: the rank an event of the controller carries
CONTROLLER_RANK = -1
#: the fields of an iteration record besides `iteration`
RECORD_FIELDS = ("loss", "grad_norm", "lr", "consumed_samples")


def iteration_record(iteration: int, fields: dict[str, Any]) -> dict[str, Any]:
    """An iteration record: `iteration` and the fields of `RECORD_FIELDS` (None where absent)."""
    return {"iteration": int(iteration), **{k: fields.get(k) for k in RECORD_FIELDS}}



def validate_record(value: Any) -> dict[str, Any] | None:
    """Check an iteration record (an ``iteration`` event's fields) from an untrusted source.

    Args:
        value: the decoded record, e.g. one line of the events file or a network message.

    Returns:
        The record with its known keys (``iteration``, ``loss``, ``grad_norm``, ``lr``,
        ``consumed_samples``), or None when it is not one: another type, an unknown key, an
        iteration below 1, or a value that is not an int or float where one is required.
    """
    if not isinstance(value, dict) or set(value) - {"iteration", *RECORD_FIELDS}:
        return None
    iteration = value.get("iteration")
    if type(iteration) is not int or iteration < 1 or type(value.get("loss")) not in (int, float):
        return None
    for key in ("grad_norm", "lr", "consumed_samples"):
        if value.get(key) is not None and type(value[key]) not in (int, float):
            return None
    if value.get("consumed_samples") is not None and type(value["consumed_samples"]) is not int:
        return None
    return iteration_record(iteration, value)

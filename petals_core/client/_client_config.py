"""Petals' name for the client's settings: :class:`ClientConfig`."""

from __future__ import annotations

from typing import Any, Final

import attrs

from .._errors import ConfigError
from ._sequence_manager import SequenceManagerConfig

__all__ = ["PETALS_MANAGER_NAMES", "ClientConfig", "with_our_names"]

#: Petals' names of the :class:`SequenceManagerConfig` times, taken as well as ours (seconds
#: either way).
PETALS_MANAGER_NAMES: Final = {
    "connect_timeout": "connect_timeout_s",
    "request_timeout": "request_timeout_s",
    "update_period": "update_period_s",
    "min_backoff": "min_backoff_s",
    "max_backoff": "max_backoff_s",
    "ban_timeout": "ban_timeout_s",
    "ping_timeout": "ping_timeout_s",
}


def with_our_names(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with Petals' names of times replaced by ours; :class:`ConfigError` if both
    names of one field are given."""
    fields = dict(fields)
    for petals_name, name in PETALS_MANAGER_NAMES.items():
        if petals_name in fields:
            if name in fields:
                raise ConfigError(f"give {name} or {petals_name} (Petals' name for it), not both")
            fields[name] = fields.pop(petals_name)
    return fields


@attrs.frozen(kw_only=True, init=False)
class ClientConfig(SequenceManagerConfig):
    """A :class:`SequenceManagerConfig` under Petals' name, built from Petals' field names too:
    ``ClientConfig(initial_peers=[...], request_timeout=30)`` is
    ``SequenceManagerConfig(initial_peers=[...], request_timeout_s=30)``."""

    def __init__(self, **fields: Any) -> None:
        self.__attrs_init__(**with_our_names(fields))

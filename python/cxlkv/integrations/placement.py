"""Which device of a striped pool a serving process stores its KV on (docs/ARCHITECTURE.md §12).

SAC (§4.3.3) keeps one request's KV on one CXL device and spreads GPU ranks over the devices
round-robin, so parallel ranks load over different links. The connector's ``pool_device`` extra
config chooses: absent or None (interleaved over every device), an int (that device), or
``"tp_rank"`` (tensor-parallel rank modulo the device count). vLLM-free, so it is unit-tested.
"""

from __future__ import annotations

from typing import Any


def placement_device(choice: Any, tp_rank: int, device_count: int) -> int | None:
    """The device index for ``choice`` (see the module doc), or None for "anywhere". Raises
    ValueError for a choice it does not understand or a device the pool does not have."""
    if choice is None or choice == "" or device_count <= 1:
        return None
    if choice == "tp_rank":
        return tp_rank % device_count
    if isinstance(choice, bool) or not isinstance(choice, (int, str)):
        raise ValueError(f"pool_device must be an int, 'tp_rank' or null, not {choice!r}")
    try:
        device = int(choice)
    except ValueError:
        raise ValueError(f"pool_device must be an int, 'tp_rank' or null, not {choice!r}") from None
    if not 0 <= device < device_count:
        raise ValueError(f"pool_device {device} out of range: the pool has {device_count} devices")
    return device

"""Cards by name, for the planner's budgets: the memory torch reports for each.

The figures are ``torch.cuda.get_device_properties(0).total_memory`` as torch's out-of-memory messages print
it ("GPU 0 has a total capacity of 79.18 GiB"): measured on this project's H100 (``NVIDIA H100 80GB HBM3``),
and as widely reported for the others. A card whose figure varies between reports (the L4, the A10G) is left
out: pass its size (``"22GiB"``).
"""

from __future__ import annotations

from lightning_gpumem._core.kernels import Device, device_for
from lightning_gpumem._core.units import GIB

CARD_MEMORY_GIB = {
    "H100-80GB": 79.18,
    "A100-80GB": 79.15,
    "A100-40GB": 39.39,
    "RTX4090": 23.65,
}


# compute capability's major, multiprocessors, threads per multiprocessor: what a trace's kernels read of the
# card (``_core/kernels.py``); the H100 SXM's measured, the others' from their data sheets
CARD_PROPERTIES = {
    "H100-80GB": (9, 132, 2048),
    "A100-80GB": (8, 108, 2048),
    "A100-40GB": (8, 108, 2048),
    "RTX4090": (8, 128, 1536),
}


def card_device(value: object) -> Device | None:
    """The kernels' view of the card ``value`` names (``None``: not a card's name).

    >>> card_device("A100-40GB").multiprocessors, card_device("A100-40GB").attention
    (108, 'flash')
    """
    key = _key(value)
    return None if key not in CARD_PROPERTIES else device_for(*CARD_PROPERTIES[key])


def _key(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    return value.strip().upper().replace(" ", "").replace("_", "-")


def card_bytes(value: object) -> int | None:
    """The memory of the card ``value`` names, in bytes (``None``: not a card's name).

    Case, spaces and underscores do not matter.

    >>> card_bytes("h100-80gb") == int(79.18 * GIB), card_bytes("RTX 4090") == int(23.65 * GIB)
    (True, True)
    >>> card_bytes("24GiB") is None
    True
    """
    key = _key(value)
    gib = None if key is None else CARD_MEMORY_GIB.get(key)
    return None if gib is None else int(gib * GIB)

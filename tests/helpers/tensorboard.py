"""Reading back what a fit wrote for TensorBoard."""

from __future__ import annotations


def read_layouts(event_files) -> list:
    """The Custom Scalars layouts written into `event_files` (TensorBoard event files), in their order."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    from lightning_gpumem.report._events import _fields, _records

    found = []
    for file in event_files:
        for record in _records(file.read_bytes(), file):
            for number, _, summary in _fields(record):
                if number != 5:
                    continue
                for _, _, value in _fields(summary):
                    fields = {n: v for n, _, v in _fields(value)}
                    if fields.get(1) == b"custom_scalars__config__":
                        tensor = {n: v for n, _, v in _fields(fields[8])}
                        found.append(layout_pb2.Layout.FromString(tensor[8]))
    return found

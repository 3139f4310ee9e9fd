"""How fast can a model's weights be copied to host memory? Ways of taking the tuner's state snapshot, timed.

    PYTHONPATH=. python3 benchmarks/snapshot_cost.py --models gpt,hf-gpt2 --json out.json   # one CUDA GPU
    PYTHONPATH=. python3 benchmarks/snapshot_cost.py --quick                                # CPU smoke run

For each workload's model (``benchmarks/_tuner_models.py``, fp32 on the GPU), in this order in one process, the wall
time (GPU synchronised before and after) of: ``package``: ``ModelState``'s ``_copy_to_host`` of the state dict as it
is now (one pageable tensor per entry); ``dedup``: the same with storages shared by several entries copied once;
``flat-fresh``: one new pageable buffer, each tensor copied into its slice; ``flat-touched``: the same into a buffer
already written (page faults paid before); ``pinned-alloc`` and ``pinned-copy``: a page-locked buffer from torch's
host allocator, then the copies into it (``non_blocking``); ``register`` and ``register-copy``: a fresh pageable
buffer page-locked with ``cudaHostRegister``, then the copies; ``restore-pageable`` / ``restore-pinned``: copying the
weights back from the package's copy and from the pinned one. Each variant twice; the first and the second times
are reported. Prints a JSON object; ``--json`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tuner_models as M

from lightning_gpumem.tuning.trials import model_state


def _timed(fn: Any, cuda: bool) -> tuple[float, Any]:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _dedup(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for key, tensor in state.items():
        ident = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if ident not in seen:
            seen[ident] = tensor.detach().to("cpu", copy=True)
        out[key] = seen[ident]
    return out


def _unique(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for tensor in state.values():
        if tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        out.append(tensor.detach())
    return out


def _into(
    buffer: torch.Tensor, tensors: list[torch.Tensor], non_blocking: bool = False
) -> list[torch.Tensor]:
    views = []
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor, non_blocking=non_blocking)
        views.append(view)
        offset += (nbytes + 511) // 512 * 512
    return views


def _total(tensors: list[torch.Tensor]) -> int:
    return sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in tensors)


def measure(name: str, quick: bool) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = M.build_model(M.workload(name, quick)).to(device)
    state = model.state_dict()
    tensors = _unique(state)
    total = _total(tensors)
    out: dict[str, Any] = {
        "model": name,
        "entries": len(state),
        "unique_tensors": len(tensors),
        "state_dict_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "unique_bytes": total,
    }

    def twice(label: str, fn: Any) -> Any:
        times = []
        result = None
        for _ in range(2):
            result = None
            seconds, result = _timed(fn, cuda)
            times.append(round(seconds, 4))
        out[label] = times
        return result

    kept = twice("package", lambda: model_state._copy_to_host(state))
    twice("dedup", lambda: _dedup(state))
    twice("flat-fresh", lambda: _into(torch.empty(total, dtype=torch.uint8), tensors))
    touched = torch.ones(total, dtype=torch.uint8)
    twice("flat-touched", lambda: _into(touched, tensors))
    if cuda:
        pinned_holder: list[torch.Tensor] = []

        def pinned_alloc() -> None:
            pinned_holder[:] = [torch.empty(total, dtype=torch.uint8, pin_memory=True)]

        twice("pinned-alloc", pinned_alloc)
        pinned = twice("pinned-copy", lambda: _into(pinned_holder[0], tensors, non_blocking=True))
        cudart = torch.cuda.cudart()

        def register() -> torch.Tensor:
            buffer = torch.empty(total, dtype=torch.uint8)
            code = cudart.cudaHostRegister(buffer.data_ptr(), total, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister: {code}")
            return buffer

        registered: list[torch.Tensor] = []
        times = []
        for _ in range(2):
            seconds, buffer = _timed(register, cuda)
            registered.append(buffer)
            times.append(round(seconds, 4))
        out["register"] = times
        twice("register-copy", lambda: _into(registered[-1], tensors, non_blocking=True))
        for buffer in registered:
            cudart.cudaHostUnregister(buffer.data_ptr())
        twice("restore-pageable", lambda: model.load_state_dict(kept))

        def restore_pinned() -> None:
            with torch.no_grad():
                for tensor, view in zip(tensors, pinned, strict=True):
                    tensor.copy_(view, non_blocking=True)

        twice("restore-pinned", restore_pinned)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default="gpt,hf-gpt2")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny models")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    results = []
    for name in args.models.split(","):
        results.append(measure(name, args.quick))  # its model and copies freed on return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    text = json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "results": results}, indent=1)  # fmt: skip
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

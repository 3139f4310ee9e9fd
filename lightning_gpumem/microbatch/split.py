"""AutoMicrobatch's pure parts: splitting a batch, combining micro-batches' logs, when to split or grow back.

No Trainer here: :mod:`lightning_gpumem.microbatch.callback` wires these to Lightning.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection


def batch_length(batch: Any) -> int | None:
    """The size of a batch's first dimension: that of its first tensor with a dimension (``None``: none)."""
    found: list[int] = []

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > 0 and not found:
            found.append(int(tensor.shape[0]))
        return tensor

    apply_to_collection(batch, torch.Tensor, visit)
    return found[0] if found else None


def split_batch(batch: Any, k: int) -> list[tuple[Any, int]]:
    """``batch`` cut into ``k`` micro-batches along the first dimension, with their sizes.

    The batch dimension is the first dimension of its first tensor, as Lightning's ``extract_batch_size``
    takes it; every tensor is split along it (``torch.tensor_split``: sizes differ by at most one, the larger
    first), and so is every list or tuple of non-tensors as long as the batch (e.g. a list of file names);
    other leaves are given whole to every micro-batch. Nested lists, tuples, dicts and dataclasses keep their
    structure.

    Raises:
        ValueError: when the batch holds no tensor with a dimension, or a tensor whose first dimension is not
            the batch's (a batch given as a list of per-sample tensors, as torchvision's detection models
            take it): which dimension to split cannot be told, so nothing is split.

    Example:
        >>> chunks = split_batch({"x": torch.arange(5), "names": list("abcde"), "tag": "t"}, 2)
        >>> [(c["x"].tolist(), c["names"], c["tag"], n) for c, n in chunks]
        [([0, 1, 2], ['a', 'b', 'c'], 't', 3), ([3, 4], ['d', 'e'], 't', 2)]
    """
    length = batch_length(batch)
    if length is None:
        raise ValueError("the batch holds no tensor with a batch dimension to split")
    others: list[int] = []

    def check(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > 0 and tensor.shape[0] != length:
            others.append(int(tensor.shape[0]))
        return tensor

    apply_to_collection(batch, torch.Tensor, check)
    if others:
        raise ValueError(
            f"the batch's tensors do not share their first dimension ({length} and {sorted(set(others))}),"
            " so the batch dimension cannot be told"
        )
    k = min(k, length)
    bounds = [0]
    for part in torch.tensor_split(torch.arange(length), k):
        bounds.append(bounds[-1] + len(part))
    return [
        (_take(batch, length, k, index, bounds), bounds[index + 1] - bounds[index]) for index in range(k)
    ]


def _take(node: Any, length: int, k: int, index: int, bounds: list[int]) -> Any:
    """Micro-batch ``index`` of ``node``.

    Tensors and batch-long sequences of non-tensors are split, the rest given whole.
    """
    if isinstance(node, torch.Tensor):
        return node if node.dim() == 0 else torch.tensor_split(node, k)[index]
    if isinstance(node, (list, tuple)) and len(node) == length and not any(_has_tensor(v) for v in node):
        part = node[bounds[index] : bounds[index + 1]]
        return type(node)(part) if not hasattr(node, "_fields") else type(node)(*part)
    if isinstance(node, (list, tuple)) or dataclasses.is_dataclass(node) or isinstance(node, Mapping):
        return _map(node, length, k, index, bounds)
    return node


def _map(node: Any, length: int, k: int, index: int, bounds: list[int]) -> Any:
    """``node``'s container rebuilt around :func:`_take` of its items."""
    if isinstance(node, Mapping):
        taken = {key: _take(value, length, k, index, bounds) for key, value in node.items()}
        return type(node)(taken)  # type: ignore[call-arg]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {
            f.name: _take(getattr(node, f.name), length, k, index, bounds)
            for f in dataclasses.fields(node)
            if f.init
        }
        return dataclasses.replace(node, **changes)
    items = [_take(value, length, k, index, bounds) for value in node]
    return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)


def _has_tensor(node: Any) -> bool:
    found: list[torch.Tensor] = []
    apply_to_collection(node, torch.Tensor, found.append)
    return bool(found)


@dataclass
class LogCall:
    """One ``self.log`` call of a micro-batch: its arguments and the micro-batch's size."""

    name: str
    value: Any
    kwargs: dict[str, Any]
    size: int


def combine_logs(calls: list[LogCall]) -> list[tuple[str, Any, dict[str, Any]]]:
    """What one unsplit step would have logged, from the micro-batches' calls, in first-call order.

    Per name: a ``mean`` (the default) is the mean weighted by micro-batch size, ``sum`` the sum,
    ``max``/``min`` the largest/smallest; a metric object (``torchmetrics.Metric``, updated by every
    micro-batch) is logged once; any other value or reduction takes the last micro-batch's value. A
    ``batch_size`` given per micro-batch is summed.

    Example:
        >>> calls = [LogCall("loss", torch.tensor(1.0), {}, 3), LogCall("loss", torch.tensor(4.0), {}, 1)]
        >>> [(name, round(float(value), 2)) for name, value, _ in combine_logs(calls)]
        [('loss', 1.75)]
    """
    by_name: dict[str, list[LogCall]] = {}
    for call in calls:
        by_name.setdefault(call.name, []).append(call)
    out = []
    for name, group in by_name.items():
        last = group[-1]
        kwargs = dict(last.kwargs)
        if len(group) > 1 and all(c.kwargs.get("batch_size") is not None for c in group):
            kwargs["batch_size"] = sum(int(c.kwargs["batch_size"]) for c in group)
        out.append(
            (
                name,
                _combine([c.value for c in group], [c.size for c in group], kwargs.get("reduce_fx")),
                kwargs,
            )
        )
    return out


def _combine(values: list[Any], sizes: list[int], reduce_fx: Any) -> Any:
    if len(values) == 1:
        return values[0]
    numeric = all(isinstance(v, (torch.Tensor, numbers.Number)) and not isinstance(v, bool) for v in values)
    if not numeric or any(isinstance(v, torch.Tensor) and v.numel() != 1 for v in values):
        return values[-1]  # a metric object, a dict, a vector: the last micro-batch's
    stacked = torch.stack(
        [torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(()) for v in values]
    )
    reduce = reduce_fx if reduce_fx is not None else "mean"
    if reduce in ("mean", torch.mean):
        weights = torch.tensor(sizes, dtype=torch.float64)
        result = (stacked * weights).sum() / weights.sum()
    elif reduce in ("sum", torch.sum):
        result = stacked.sum()
    elif reduce in ("max", torch.max):
        result = stacked.max()
    elif reduce in ("min", torch.min):
        result = stacked.min()
    else:
        return values[-1]
    template = values[-1]
    if isinstance(template, torch.Tensor):
        return result.to(dtype=template.dtype, device=template.device)
    return float(result)


@dataclass
class MicrobatchPolicy:
    """How many micro-batches the next batch runs as: doubled on an OOM, halved again after a quiet period.

    After an OOM the split stays for ``grow_after`` optimizer steps, then one step tries half as many
    micro-batches; if that step runs out of memory too, the split doubles back and the wait doubles (16, 32,
    64, ... steps by default); once it runs, the wait starts over. ``cannot_fit`` (from the measured peak)
    skips a try as if it had failed.

    Example:
        >>> policy = MicrobatchPolicy(grow_after=2)
        >>> policy.after_oom(step=5, length=8), policy.next_k(step=6), policy.next_k(step=7)
        (2, 2, 1)
        >>> policy.after_oom(step=7, length=8), policy.wait  # the try failed: back to 2, twice the wait
        (2, 4)
    """

    grow_after: int = 16
    k: int = 1
    wait: int = field(init=False)
    since: int = 0  # the step at which ``k`` was last set
    trying_from: int | None = None  # the split a try came from (``None``: not trying)
    oom_recoveries: int = 0

    def __post_init__(self) -> None:
        self.wait = self.grow_after

    def next_k(self, step: int, cannot_fit: Callable[[int], bool] | None = None) -> int:
        """The split for the step starting now (may begin a try of half the micro-batches)."""
        if self.k > 1 and self.trying_from is None and step - self.since >= self.wait:
            if cannot_fit is not None and cannot_fit(self.k // 2):
                # the measured peak says it would not fit: as failed
                self.since, self.wait = step, self.wait * 2
            else:
                self.trying_from, self.k = self.k, self.k // 2
        return self.k

    def after_success(self, step: int) -> bool:
        """The step ran: a try that ran is accepted (and the wait starts over); returns whether one was."""
        if self.trying_from is None:
            return False
        self.trying_from, self.since, self.wait = None, step, self.grow_after
        return True

    def adopt(self, k: int, wait: int, step: int, count: bool) -> None:
        """Take the split and wait the ranks agreed on after an OOM on one (``count``: it was another's)."""
        self.k, self.wait, self.since, self.trying_from = k, wait, step, None
        if count:
            self.oom_recoveries += 1

    def after_oom(self, step: int, length: int) -> int | None:
        """The split to re-run the step with after an OOM.

        ``None`` when the batch cannot be split further.
        """
        if self.trying_from is not None:  # the try failed: back to the split that ran, and wait longer
            k, self.wait = self.trying_from, self.wait * 2
        else:
            k, self.wait = self.k * 2, self.grow_after
        self.trying_from = None
        if k > length:
            return None
        self.k, self.since = k, step
        self.oom_recoveries += 1
        return k


class UpdateWatch:
    """Whether an optimizer step that failed had begun to change its parameters or state.

    Then it cannot be re-run.

    :meth:`note` runs in ``on_before_optimizer_step`` (after the forward, backward and clipping, before the
    update): it notes the version counters (bumped by every in-place op) of a few sentinels, per parameter
    group the first parameter with a gradient of each device and dtype, and of their state, and how many
    parameters had state. PyTorch's optimizers skip parameters without a gradient and update the rest group
    by group and, within one, in parameter order or all at once (``foreach``, ``fused``), so an update that
    has begun has changed a sentinel or its state (state created in the failed step counts once written to).
    State an optimizer created in a step that changed nothing is dropped by :meth:`forget_new_state`, so that
    the re-run creates it whole.
    """

    def __init__(self) -> None:
        self._sentinels: dict[int, list[torch.Tensor]] = {}
        self._seen: list[
            tuple[torch.optim.Optimizer, int, list[tuple[torch.Tensor, int, dict[Any, int]]]]
        ] = []

    def clear(self) -> None:
        """Forget every optimizer and sentinel (the step is over)."""
        self._sentinels, self._seen = {}, []

    def start(self) -> None:
        """A new attempt at the step: forget what earlier attempts saw."""
        self._seen = []

    def note(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer is about to update: note its sentinels' versions, how many parameters have state."""
        sentinels = self._sentinels.get(id(optimizer))
        if sentinels is None or any(param.grad is None for param in sentinels):
            sentinels = self._sentinels[id(optimizer)] = _sentinels(optimizer)
        noted = []
        for param in sentinels:
            state = optimizer.state.get(param, {})
            versions = {
                key: value._version for key, value in state.items() if isinstance(value, torch.Tensor)
            }
            noted.append((param, param._version, versions))
        self._seen.append((optimizer, len(optimizer.state), noted))

    def changed(self) -> bool:
        """Whether an update noted in this attempt has changed a sentinel or its state since it was noted."""
        for optimizer, _, noted in self._seen:
            for param, version, state_versions in noted:
                if param._version != version:
                    return True
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value._version != state_versions.get(key, 0):
                        return True
        return False

    def forget_new_state(self) -> None:
        """Drop the state the failed attempt's optimizers created (maybe half: an OOM while creating it)."""
        for optimizer, count, _ in self._seen:
            # the state dict keeps the order its entries were made in
            for param in list(optimizer.state)[count:]:
                del optimizer.state[param]


def _sentinels(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Per parameter group, the first parameter with a gradient of each (device, dtype)."""
    found = []
    for group in optimizer.param_groups:
        kinds: set[tuple[torch.device, torch.dtype]] = set()
        for param in group["params"]:
            if param.grad is not None and (param.device, param.dtype) not in kinds:
                kinds.add((param.device, param.dtype))
                found.append(param)
    return found

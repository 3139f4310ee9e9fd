"""A traced stream replayed as a fit runs it: training steps until the allocator's layout stops changing.

Why: a trace holds a few training steps, a fit hundreds. The requests of every step after the first are the
same, but the cache they meet is not: blocks freed by one step are split and merged by the next, and a size
whose first two steps fit can run out of memory in its third (the 236M GPT at 17 under 12 GiB on an H200).
So the last traced step is repeated, its blocks renamed, until a step leaves the allocator exactly as the one
before it did (every later step would then do the same), and validation follows the last one. Pure: the
allocator model and the stream, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem.tuning.sources.allocator import AllocatorModel, Replay

MAX_STEPS = 16  # training steps replayed at most; a layout still changing after them is taken as it is


def split_steps(events: Sequence[Event]) -> tuple[list[Event], list[list[Event]], list[Event]]:
    """What comes before the first training step, each step (from its ``"train"`` mark), and the rest.

    The rest begins at the ``"val"`` mark (empty without one).

    >>> stream = [Event("alloc", 1, 8), Event("mark", label="train"), Event("alloc", 2, 4), Event("free", 2)]
    >>> head, steps, tail = split_steps([*stream, Event("mark", label="train"), Event("mark", label="val")])
    >>> len(head), [len(step) for step in steps], len(tail)
    (1, [3, 1], 1)
    """
    head: list[Event] = []
    steps: list[list[Event]] = []
    tail: list[Event] = []
    for event in events:
        if tail or (event.action == "mark" and event.label == "val"):
            tail.append(event)
        elif event.action == "mark" and event.label == "train":
            steps.append([event])
        elif steps:
            steps[-1].append(event)
        else:
            head.append(event)
    return head, steps, tail


def next_step(before: Sequence[Event], last: Sequence[Event], first_block: int) -> list[Event] | None:
    """The step after ``last``, which followed ``before``: ``last`` again, its blocks renumbered.

    The new blocks are numbered from ``first_block``.

    What ``last`` frees of its own, the next step frees of its own; what ``last`` frees of ``before`` (the
    gradients its ``zero_grad`` drops), the next frees of ``last``. ``None`` where the two steps are not the
    same requests in the same order, or ``last`` frees a block older than ``before``: then no step follows.

    >>> def step(grads, new):  # frees the previous step's gradient, makes a temporary and a gradient
    ...     return [Event("mark", label="train"), Event("free", grads), Event("alloc", new, 64),
    ...             Event("free", new), Event("alloc", new + 1, 8)]
    >>> following = next_step(step(1, 2), step(3, 4), 10)
    >>> following == step(5, 10)
    True
    """
    if len(before) != len(last):
        return None
    made, kept = _made(before), _made(last)
    renamed = {block: first_block + at for at, block in enumerate(kept)}
    carried = dict(zip(made, kept, strict=False))  # a block of `before`: the same block of `last`
    following = []
    for old, new in zip(before, last, strict=True):
        if (old.action, old.size, old.stream, old.label, old.kernel) != (
            new.action,
            new.size,
            new.stream,
            new.label,
            new.kernel,
        ):
            return None
        if new.action == "alloc":
            following.append(new.renamed(renamed[new.block]))
        elif new.action == "free":
            if new.block in renamed and carried.get(old.block) == new.block:
                following.append(new.renamed(renamed[new.block]))
            elif new.block in carried and old.block not in carried:  # `before` freed an older step's block
                following.append(new.renamed(carried[new.block]))
            else:
                return None
        else:
            following.append(new)
    return following


def replay_steady(
    events: Sequence[Event],
    *,
    limit_bytes: int | None = None,
    expandable_segments: bool = False,
    max_steps: int = MAX_STEPS,
) -> tuple[Replay, int]:
    """Replay ``events`` with its last training step repeated until the layout settles; the steps replayed.

    Like :func:`~lightning_gpumem.tuning.sources.allocator.replay` (it stops at the first request refused),
    with the steps of :func:`next_step` after the traced ones, as long as each leaves a layout unlike the one
    before it and at most ``max_steps`` in all; then the validation the stream ends with.

    >>> from lightning_gpumem.tuning.sources.allocator import replay
    >>> stream = [Event("alloc", 1, 4096)]
    >>> for step, grads in ((2, None), (4, 3), (6, 5)):
    ...     stream += [Event("mark", label="train"), *([Event("free", grads)] if grads else []),
    ...                Event("alloc", step, 1 << 20), Event("free", step), Event("alloc", step + 1, 512)]
    >>> result, steps = replay_steady(stream)  # the third step left the layout as the second did: settled
    >>> steps, result.peak_reserved == replay(stream).peak_reserved
    (3, True)
    """
    head, steps, tail = split_steps(events)
    model = AllocatorModel(limit_bytes=limit_bytes, expandable_segments=expandable_segments)
    if not _feed(model, head):
        return model.result(), 0
    renamed: dict[int, int] = {}  # a block of the last traced step: its block in the step replayed last
    ran = 0
    layout = previous_layout = None
    for step in steps:
        ran += 1
        if not _feed(model, step):
            return model.result(), ran
        layout, previous_layout = model.layout(), layout
    next_block = 1 + max((e.block for e in events if e.action == "alloc"), default=0)
    before, last = (steps[-2], steps[-1]) if len(steps) >= 2 else (None, None)
    older = {block for step in steps[:-1] for block in _made(step)}
    if any(e.action == "free" and e.block in older for e in tail):  # validation frees an older step's block
        before = None
    while before is not None and last is not None and ran < max_steps and layout != previous_layout:
        following = next_step(before, last, next_block)
        if following is None:
            break
        moved = dict(zip(_made(last), _made(following), strict=True))
        renamed = {old: moved[renamed.get(old, old)] for old in _made(steps[-1])}
        next_block += sum(e.action == "alloc" for e in following)
        before, last = last, following
        ran += 1
        if not _feed(model, following):
            return model.result(), ran
        layout, previous_layout = model.layout(), layout
    _feed(model, [e.renamed(renamed.get(e.block, e.block)) for e in tail])
    return model.result(), ran


def _made(step: Sequence[Event]) -> list[int]:
    """The blocks a step allocates, in order."""
    return [e.block for e in step if e.action == "alloc"]


def _feed(model: AllocatorModel, events: Sequence[Event]) -> bool:
    """Replay ``events`` into ``model``; ``False`` at the first request it refuses."""
    for event in events:
        if event.action == "alloc":
            if not model.malloc(event.block, event.size, event.stream):
                return False
        elif event.action == "free":
            model.free(event.block)
        else:
            model.mark(event.label)
    return True

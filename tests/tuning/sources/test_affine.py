"""Streams made from three traced sizes: exact where the step is affine in the batch size, never trusted blindly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._hw.trace import trace_training
from lightning_gpumem.tuning.sources.affine import AffineStreams
from lightning_gpumem.tuning.sources.traced import TracedSource, plan_by_trace

GIB = 2**30


def stream(n: int, per_sample: int = 8, extra: int = 0) -> list[Event]:
    return [
        Event("alloc", 1, 64),
        Event("mark", label="train"),
        Event("alloc", 2, 100 + per_sample * n + extra),
        Event("free", 2),
    ]


def test_three_affine_sizes_make_any_size_exactly():
    streams = AffineStreams()
    streams.learn({2: stream(2), 3: stream(3)})
    assert streams.state == "unknown"  # two sizes prove nothing
    streams.learn({2: stream(2), 3: stream(3), 7: stream(7)})
    assert streams.state == "on"
    assert streams.at(1000) == stream(1000)


@pytest.mark.parametrize(
    "third",
    [
        stream(7, extra=512),  # the third size is off the line
        stream(7)[:3],  # a request fewer
        [*stream(7)[:2], Event("alloc", 3, 156), Event("free", 3)],  # another block
    ],
    ids=["off-the-line", "shorter", "other-block"],
)
def test_a_third_size_that_is_not_what_the_first_two_say_turns_it_off(third):
    streams = AffineStreams()
    streams.learn({2: stream(2), 3: stream(3), 7: third})
    assert streams.state == "off"
    assert streams.at(100) is None


def test_bytes_that_are_not_a_whole_number_per_sample_are_not_affine():
    streams = AffineStreams()
    streams.learn({2: stream(2), 4: stream(3), 6: stream(4)})  # 4 bytes over 2 samples: 2 per sample...
    assert streams.state == "on"
    odd = AffineStreams()
    odd.learn({2: stream(2), 5: stream(3), 8: stream(4)})  # 8 bytes over 3 samples
    assert odd.state == "off"


def test_a_request_that_would_shrink_below_nothing_is_not_made():
    streams = AffineStreams()
    streams.learn({10: stream(10, -8, 200), 11: stream(11, -8, 200), 12: stream(12, -8, 200)})
    assert streams.state == "on"
    assert streams.at(20) == stream(20, -8, 200)
    assert streams.at(100) is None


class Branchy(nn.Module):
    """An MLP whose step doubles its activations above a batch of 8: not affine in the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:
            x = torch.cat([x, x])
        return self.net(x)


def tracer(module: nn.Module):
    def trace_at(size: int):
        return trace_training(
            module,
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            lambda m, x: m(x).sum(),
            torch.randn(size, 256),
        )

    return trace_at


def test_the_streams_made_for_a_real_step_are_its_traces():
    torch.manual_seed(0)
    module = Branchy().net  # no branch: affine
    source = TracedSource(tracer(module))
    for size in (2, 3, 5):
        source.replay(size)
    assert source.affine.state == "on"
    for size in (4, 17, 64):
        source.replay(size)
        assert source.traces[size] == TracedSource(tracer(module), synthesise=False)._trace(size)
    assert source.affine.synthesised == {4, 17, 64}
    assert source.confirm()


def test_a_step_that_branches_on_the_batch_size_is_caught_and_planned_by_traces_alone():
    torch.manual_seed(0)
    module = Branchy()
    made = TracedSource(tracer(module))
    plan = plan_by_trace(made, 4, [GIB // 8, GIB // 4], upper=4096, outside=0)
    assert made.affine.state == "off"  # learned from 2, 4 and 8, then the largest made size was traced
    assert not made.affine.synthesised
    traced = plan_by_trace(
        TracedSource(tracer(module), synthesise=False), 4, [GIB // 8, GIB // 4], upper=4096, outside=0
    )
    assert [p.largest for p in plan.predictions] == [p.largest for p in traced.predictions]
    assert all(p.largest and p.largest > 8 for p in plan.predictions)


def test_a_plan_from_made_streams_is_the_plan_from_traces_and_traces_fewer_sizes():
    torch.manual_seed(0)
    module = Branchy().net
    made = TracedSource(tracer(module))
    plan = plan_by_trace(made, 4, [GIB // 8, GIB // 4], upper=4096, outside=0)
    alone = TracedSource(tracer(module), synthesise=False)
    traced = plan_by_trace(alone, 4, [GIB // 8, GIB // 4], upper=4096, outside=0)
    assert plan.predictions == traced.predictions
    assert made.affine.state == "on"
    assert len(made.traced) == 4 < len(alone.traced)  # 2, 4, 8 and the largest made size, to confirm


def test_unchecked_streams_are_believed_from_two_traced_sizes():
    def traced(n):
        return [Event("alloc", 1, 100 + 8 * n), Event("mark", label="train"), Event("free", 1)]

    checked, unchecked = AffineStreams(), AffineStreams(checked=False)
    for streams in (checked, unchecked):
        streams.learn({2: traced(2), 5: traced(5)})
    assert checked.state == "unknown"
    assert unchecked.state == "on"
    assert unchecked.at(40) == traced(40)
    misaligned = AffineStreams(checked=False)
    misaligned.learn({2: traced(2), 5: [*traced(5), Event("alloc", 2, 4)]})
    assert misaligned.state == "off"

"""MetaMemo: a meta kernel asked once per signature, its outputs made again from memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_gpumem._hw.trace as _trace
from lightning_gpumem._hw.meta_memo import MetaMemo
from lightning_gpumem._hw.trace import trace_training

aten = torch.ops.aten


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def same_metadata(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.untyped_storage().nbytes()) == (
        b.shape,
        b.stride(),
        b.dtype,
        b.untyped_storage().nbytes(),
    )


def test_a_signature_seen_is_made_from_memory_with_the_kernels_metadata():
    memo = MetaMemo()
    x, w = meta(6, 8).t(), meta(6, 3)  # a transposed input: the output's strides are the kernel's
    first = memo(aten.mm.default, (x, w), {})
    again = memo(aten.mm.default, (x, w), {})
    assert memo.hits == 1
    assert same_metadata(first, again)
    assert same_metadata(again, aten.mm.default(x, w))
    assert again.untyped_storage() is not first.untyped_storage()  # a new tensor, as the kernel's


def test_several_outputs_and_none_among_them_are_made_again():
    memo = MetaMemo()
    x, weight = meta(2, 5, 16, dtype=torch.bfloat16), meta(16)
    args = (x, [16], weight, weight, 1e-5)
    first = memo(aten.native_layer_norm.default, args, {})
    again = memo(aten.native_layer_norm.default, args, {})
    assert memo.hits == 1
    assert type(again) is type(first)
    assert all(same_metadata(a, b) for a, b in zip(first, again))
    grads = (x, x, [16], first[1], first[2], weight, weight, [True, False, True])
    out = memo(aten.native_layer_norm_backward.default, grads, {})
    made = memo(aten.native_layer_norm_backward.default, grads, {})
    assert memo.hits == 2
    assert out[1] is None
    assert made[1] is None
    assert same_metadata(out[0], made[0])
    assert same_metadata(out[2], made[2])


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("a view", lambda memo, x: memo(aten.view.default, (x, [8, 3]), {})),
        ("in place", lambda memo, x: memo(aten.mul_.Tensor, (x, x), {})),
        ("out=", lambda memo, x: memo(aten.mul.out, (x, x), {"out": meta(4, 6)})),
        ("a CPU tensor", lambda memo, x: memo(aten.mul.Tensor, (torch.ones(4, 6), 2.0), {})),
        ("split (views)", lambda memo, x: memo(aten.split.Tensor, (x, 2), {})),
    ],
)
def test_outputs_that_are_not_new_tensors_of_their_own_are_never_made_from_memory(name, call):
    memo = MetaMemo()
    x = meta(4, 6)
    _first, again = call(memo, x), call(memo, x)
    assert memo.hits == 0, name
    if name == "in place":
        assert again is x  # the kernel ran: the input itself, as an in-place op returns it


@pytest.mark.parametrize(
    "op", [aten.nonzero.default, aten.unsqueeze_.default, aten.masked_select.default, aten.t_.default]
)
def test_ops_whose_shapes_come_from_values_or_that_change_their_input_are_never_remembered(op):
    assert not MetaMemo()._may_remember(op)
    assert MetaMemo()._may_remember(aten.mm.default)


def test_a_subclass_is_not_made_from_memory_but_a_parameter_is():
    memo = MetaMemo()
    weight = nn.Parameter(meta(4, 4))
    memo(aten.mm.default, (weight, weight), {})
    memo(aten.mm.default, (weight, weight), {})
    assert memo.hits == 1

    class Marked(torch.Tensor):
        pass

    marked = meta(4, 4).as_subclass(Marked)
    memo(aten.mm.default, (marked, marked), {})
    memo(aten.mm.default, (marked, marked), {})
    assert memo.hits == 1


def test_scalars_are_told_apart_by_type_and_value():
    memo = MetaMemo()
    x = meta(4, dtype=torch.int64)
    as_int = memo(aten.mul.Tensor, (x, 2), {})  # an int stays int64
    as_float = memo(aten.mul.Tensor, (x, 2.0), {})  # a float makes float32
    assert (as_int.dtype, as_float.dtype, memo.hits) == (torch.int64, torch.float32, 0)
    scaled = memo(aten.upsample_nearest1d.vec, (meta(1, 1, 4), None, [2.0]), {})
    doubled = memo(aten.upsample_nearest1d.vec, (meta(1, 1, 4), None, [3.0]), {})
    assert (scaled.shape[-1], doubled.shape[-1], memo.hits) == (8, 12, 0)  # a float that sets a shape


def test_an_optimizers_update_is_never_asked_and_returns_nothing_whatever_its_step_sizes():
    memo = MetaMemo()
    params = [meta(3), meta(5)]
    asked: list[str] = []

    class Counted:  # the op, its calls counted
        def __init__(self, op: torch._ops.OpOverload) -> None:
            self.op, self.tags, self.namespace = op, op.tags, op.namespace

        def name(self) -> str:
            return self.op.name()

        def __call__(self, *args: object, **kwargs: object) -> object:
            asked.append(self.name())
            return self.op(*args, **kwargs)

    update = Counted(aten._foreach_add_.ScalarList)
    assert memo(update, (params, [0.1, 0.2]), {}) is None
    assert memo(update, (params, [0.3, 0.4]), {}) is None
    assert memo.hits == 1
    assert asked == []  # neither call ran the kernel
    assert [p.shape for p in params] == [(3,), (5,)]
    square = Counted(aten._foreach_sqrt.default)  # not in place: its outputs are the kernel's, once
    roots = memo(square, (params,), {})
    again = memo(square, (params,), {})
    assert asked == ["aten::_foreach_sqrt"]
    assert [r.shape for r in roots] == [r.shape for r in again] == [(3,), (5,)]


@pytest.mark.parametrize("name", sorted(n for n in dir(aten) if n.startswith(("_foreach_", "_fused_"))))
def test_every_update_the_memo_skips_returns_nothing(name):
    packet = getattr(aten, name)
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if MetaMemo()._updates(op):
            assert len(op._schema.returns) == 0, f"{op} returns something"


def test_an_error_is_raised_each_time_never_remembered():
    memo = MetaMemo()
    a, b = meta(2, 3), meta(4, 5)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            memo(aten.mm.default, (a, b), {})
    assert memo.hits == 0


def test_the_default_dtype_and_a_tensors_conjugate_bit_are_part_of_the_signature():
    memo = MetaMemo()
    ints = meta(4, dtype=torch.int64)
    before = memo(aten.div.Tensor, (ints, ints), {})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        after = memo(aten.div.Tensor, (ints, ints), {})
    finally:
        torch.set_default_dtype(default)
    assert (before.dtype, after.dtype) == (torch.float32, torch.float64)
    plain = meta(3, dtype=torch.complex64)
    conj = plain.conj()
    assert memo(aten.resolve_conj.default, (conj,), {}) is not conj
    assert memo(aten.resolve_conj.default, (plain,), {}) is plain  # the kernel's own answer: no copy
    assert memo.hits == 0


def test_a_sparse_output_is_asked_of_its_kernel_each_time_and_the_step_traces_on_meta_tensors(monkeypatch):
    memo = MetaMemo()
    indices, values = meta(1, 3, dtype=torch.int64), meta(3, 4)
    args = (1, 1, [5, 4], indices, values)
    kwargs = {"dtype": torch.float32, "layout": torch.sparse_coo, "device": torch.device("meta")}
    for _ in range(2):
        out = memo(aten._sparse_coo_tensor_with_dims_and_tensors.default, args, kwargs)
        assert out.layout == torch.sparse_coo
    assert memo.hits == 0
    monkeypatch.setattr(_trace, "FakeTensorMode", None)  # meta tensors alone: no fallback
    net = nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 2))

    def on_meta() -> bool:
        try:
            trace = trace_training(
                net,
                lambda ps: torch.optim.SGD(ps, lr=0.1),
                lambda m, x: m(x).sum(),
                torch.zeros(4, dtype=torch.long),
                steps=2,
                meta_first=True,
            )
        except TypeError:  # the fallback's fake mode, patched out: meta tensors could not do it
            return False
        return trace.cannot_trace is None

    remembered = on_meta()
    monkeypatch.setattr(MetaMemo, "__call__", lambda self, func, args, kwargs: func(*args, **kwargs))
    plain = on_meta()
    assert remembered == plain  # the memo never makes a step leave meta tensors (torch 2.4's cannot)
    assert plain or torch.__version__ < "2.5"


def test_the_trace_on_meta_tensors_is_the_same_with_its_memo_as_without_it(monkeypatch):
    def run() -> _trace.Trace:
        encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 3, enable_nested_tensor=False
        )
        return trace_training(
            encoder,
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            lambda m, x: m(x).float().sum(),
            torch.randn(2, 32, 64),
            steps=2,
            validate=lambda m, x: m(x),
            autocast_dtype=torch.bfloat16,
            meta_first=True,
        )

    hits: list[int] = []
    call = MetaMemo.__call__

    def counted(self: MetaMemo, *args: object) -> object:
        out = call(self, *args)  # type: ignore[arg-type]
        hits.append(self.hits)
        return out

    monkeypatch.setattr(_trace, "FakeTensorMode", None)  # meta tensors alone
    monkeypatch.setattr(MetaMemo, "__call__", counted)
    remembered = run()
    assert max(hits) > 100  # the layers and the second step asked the kernels again
    monkeypatch.setattr(MetaMemo, "__call__", lambda self, func, args, kwargs: func(*args, **kwargs))
    plain = run()
    assert remembered.cannot_trace is None
    assert remembered.events == plain.events

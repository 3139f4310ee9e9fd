"""The trace of a training step on fake tensors: what it allocates and frees, checked against the real step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.kernels import H100, MEASURED_OPS, Device
from lightning_gpumem._hw import trace as _trace

# The tensors' lifetimes, checked against the real step on the CPU: without the buffers CUDA's kernels ask for
# themselves (tests/hw/test_trace_kernels.py has those); two steps, the first with gradients and optimizer
# state (tests/tuning/sources/test_steps.py has the third).
trace_training = partial(_trace.trace_training, device=None, steps=2)
record_training = partial(_trace.record_training, steps=2)
FLOAT = 4  # bytes


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def mse(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).square().mean()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def param_sizes(module: nn.Module) -> list[int]:
    return [p.numel() * p.element_size() for p in module.parameters()]


def phases(events: list[Event]) -> list[tuple[str, list[Event]]]:
    """The stream cut at its marks: ("setup", what came before the first), then (label, events) per mark."""
    cut: list[tuple[str, list[Event]]] = [("setup", [])]
    for event in events:
        if event.action == "mark":
            cut.append((event.label, []))
        else:
            cut[-1][1].append(event)
    return cut


def live_by_phase(events: list[Event]) -> tuple[list[int], list[int]]:
    """Live bytes at the end of each phase, and the peak within each phase."""
    live, sizes, ends, peaks = 0, {}, [], []
    for _, chunk in phases(events):
        peak = live
        for event in chunk:
            if event.action == "alloc":
                sizes[event.block] = event.size
                live += event.size
            else:
                live -= sizes.pop(event.block)
            peak = max(peak, live)
        ends.append(live)
        peaks.append(peak)
    return ends, peaks


def allocs(chunk: list[Event]) -> list[int]:
    return [event.size for event in chunk if event.action == "alloc"]


def test_parameters_come_first_then_marks_in_order():
    module = mlp()
    trace = trace_training(module, adamw, mse, torch.randn(8, 1024), validate=mse)
    assert trace.cannot_trace is None
    cut = phases(trace.events)
    assert [label for label, _ in cut] == ["setup", "train", "optimizer", "train", "optimizer", "val"]
    assert allocs(cut[0][1]) == param_sizes(module)
    assert all(event.stream == 0 for event in trace.events)


def test_each_block_is_freed_at_most_once_and_only_while_allocated():
    trace = trace_training(mlp(), adamw, mse, torch.randn(8, 1024), validate=mse)
    live, seen = set(), set()
    for event in trace.events:
        if event.action == "alloc":
            assert event.block not in seen
            assert event.size > 0
            seen.add(event.block)
            live.add(event.block)
        elif event.action == "free":
            assert event.block in live
            live.remove(event.block)
    assert seen - live  # activations and temporaries were freed


def test_gradients_match_the_parameters_and_live_until_the_next_steps_zero_grad():
    module = mlp()
    params = sum(param_sizes(module))
    trace = trace_training(module, sgd, mse, torch.randn(8, 1024), steps=3)
    ends, _ = live_by_phase(trace.events)
    # setup, then (train, optimizer) per step: Lightning's order keeps gradients through the next forward
    assert ends[0] == params
    assert ends[2] == ends[4] == ends[6] == 2 * params  # SGD without momentum: no state
    cut = phases(trace.events)
    grads = [e.size for e in cut[1][1] if e.action == "alloc" and e.size in param_sizes(module)]
    assert sorted(grads) == sorted(param_sizes(module))
    # the second step frees the first's gradients (zero_grad before backward) and makes new ones
    first_blocks = {e.block for e in cut[1][1] if e.action == "alloc" and e.size in param_sizes(module)}
    freed_in_second = {e.block for e in cut[3][1] if e.action == "free"}
    assert first_blocks <= freed_in_second


def test_adamw_state_is_allocated_at_the_first_step_and_kept():
    module = mlp()
    sizes = param_sizes(module)
    trace = trace_training(module, adamw, mse, torch.randn(8, 1024))
    cut = phases(trace.events)
    first_optimizer = [e for e in cut[2][1] if e.action == "alloc"]
    kept = {e.block for e in first_optimizer} - {e.block for e in trace.events if e.action == "free"}
    kept_sizes = sorted(e.size for e in first_optimizer if e.block in kept)
    assert kept_sizes == sorted(sizes * 2)  # exp_avg and exp_avg_sq; the step counters are host memory
    assert not any(e.action == "alloc" and e.size == FLOAT for e in cut[2][1])
    ends, _ = live_by_phase(trace.events)
    assert ends[4] == ends[2] == 4 * sum(sizes)  # params, grads, exp_avg, exp_avg_sq


def test_the_optimizer_takes_the_multi_tensor_path_as_on_cuda():
    module = mlp()
    params = sum(param_sizes(module))
    foreach = trace_training(module, adamw, mse, torch.randn(8, 1024))
    loop = trace_training(
        module, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), mse, torch.randn(8, 1024)
    )
    second_step = phases(foreach.events)[4][1]
    assert all(e.action == "alloc" for e in second_step[: len(param_sizes(module))])  # one op for all params
    # the second optimizer step: foreach's sqrt temporaries are all live at once; the loop's one at a time
    ends, peaks = live_by_phase(foreach.events)
    assert peaks[4] - ends[3] >= params
    ends, peaks = live_by_phase(loop.events)
    assert peaks[4] - ends[3] < params


def test_activations_grow_with_the_batch():
    module = mlp()
    small = phases(trace_training(module, sgd, mse, torch.randn(8, 1024)).events)[1][1]
    large = phases(trace_training(module, sgd, mse, torch.randn(16, 1024)).events)[1][1]
    small_sizes, large_sizes = allocs(small), allocs(large)
    assert len(small_sizes) == len(large_sizes)
    doubled = [s for s, big in zip(small_sizes, large_sizes) if big == 2 * s]
    same = [s for s, big in zip(small_sizes, large_sizes) if big == s]
    assert len(doubled) + len(same) == len(small_sizes)
    assert 8 * 4096 * FLOAT in doubled  # the hidden activations
    assert 8 * 1024 * FLOAT in doubled  # the batch, the output
    assert sorted(s for s in same if s > FLOAT) == sorted(param_sizes(module))  # the gradients


def test_the_fake_trace_equals_the_real_steps_on_cpu():
    module = mlp()
    batch = torch.randn(8, 1024)
    for make in (adamw, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        trace = trace_training(module, make, mse, batch, validate=mse)
        real = copy.deepcopy(module)
        optimizer = make(real.parameters())
        for group in optimizer.param_groups:
            group["foreach"] = True
        assert record_training(real, optimizer, mse, batch, validate=mse) == trace


def test_the_module_and_optimizer_are_untouched():
    module = mlp()
    optimizer = adamw(module.parameters())
    mse(module, torch.randn(4, 1024)).backward()
    optimizer.step()
    optimizer.zero_grad()
    module.eval()
    weights = copy.deepcopy(module.state_dict())
    state = copy.deepcopy(optimizer.state_dict())
    trace = trace_training(module, optimizer, mse, torch.randn(8, 1024), validate=mse)
    assert trace.cannot_trace is None
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert not module.training
    after = optimizer.state_dict()
    assert after["param_groups"] == state["param_groups"]  # foreach still None
    for index, values in state["state"].items():
        assert all(torch.equal(values[k], after["state"][index][k]) for k in values)
    # the copied state exists before the first mark: params, then exp_avg and exp_avg_sq
    setup = allocs(phases(trace.events)[0][1])
    assert sorted(setup) == sorted(param_sizes(module) * 3)


class ItemInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()


def test_data_dependent_ops_end_the_trace_naming_op_and_module():
    module = nn.Sequential(nn.Linear(8, 8), nn.Sequential(ItemInForward()))
    trace = trace_training(module, sgd, lambda m, x: m(x).sum(), torch.randn(2, 8))
    assert trace.cannot_trace == "cannot trace: aten._local_scalar_dense at `1.0` (ItemInForward)"
    assert [e.label for e in trace.events if e.action == "mark"] == ["train"]
    masked = trace_training(nn.Linear(8, 8), sgd, lambda m, x: m(x)[x > 0].sum(), torch.randn(2, 8))
    assert masked.cannot_trace == "cannot trace: aten.index.Tensor in the step function"


def test_dropout_keeps_a_one_byte_mask_in_training_only():
    module = nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.1))
    trace = trace_training(module, sgd, lambda m, x: m(x).sum(), torch.randn(8, 1024), validate=mse)
    cut = phases(trace.events)
    assert 8 * 1024 in allocs(cut[1][1])  # torch.bool: CPU's dropout would keep a float32 mask
    assert 8 * 1024 * FLOAT * 2 not in allocs(cut[1][1])
    assert 8 * 1024 not in allocs(cut[-1][1])  # eval: no mask
    train = allocs(cut[1][1])
    mask = train.index(8 * 1024)
    assert train[mask - 1 : mask + 2] == [
        8 * 1024 * FLOAT,
        8 * 1024,
        8 * 1024 * FLOAT,
    ]  # linear, mask, output


class UsedTwice(nn.Module):
    """``a = weight * x`` feeds two ops (``uses``): backward sums two gradients of ``a``."""

    def __init__(self, shape: tuple[int, ...], uses: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.uses = uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.uses(self.weight * x)


def relu_and_sigmoid(a: torch.Tensor) -> torch.Tensor:
    return a.relu() + a.sigmoid()


def view_first(a: torch.Tensor) -> torch.Tensor:  # the first gradient to arrive is a view (view's backward)
    return a.sigmoid().sum() + a.view(-1).relu().sum()


def doubled(a: torch.Tensor) -> torch.Tensor:  # one gradient handed to both operands
    return (a + a).relu()


def test_a_gradient_summed_from_two_uses_is_added_in_place_as_on_the_gpu():
    """The engine adds a second gradient into the first where it holds the first's only reference
    (``InputBuffer::accumulate``); under the trace's dispatch mode every tensor counts as a subclass and the sum
    would be a new tensor: the trace keeps the GPU's in-place sum."""
    n = 1 << 16
    trace = trace_training(UsedTwice((n,), relu_and_sigmoid), sgd, lambda m, x: m(x).sum(), torch.ones(n))
    train = phases(trace.events)[1][1]
    # the batch; the forward's product, ReLU, sigmoid and sum; the backward's two gradients of `a` (the second
    # summed into the first) and the weight's gradient
    assert allocs(train).count(n * FLOAT) == 1 + 4 + 3


@pytest.mark.parametrize(("uses", "shape"), [(view_first, (256, 256)), (doubled, (4096,))])
def test_gradients_the_engine_sums_out_of_place_stay_new_tensors(uses, shape, monkeypatch):
    """Where the first gradient is a view (its base shares the storage) or both operands are one tensor, the
    engine sums into a new tensor (checked on real CPU tensors: the sum's pointer is neither operand's): the
    trace keeps the new tensor."""
    module, batch = UsedTwice(shape, uses), torch.ones(shape)

    def step(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum()

    traced = trace_training(module, sgd, step, batch)
    monkeypatch.setattr(_trace._Recorder, "_gradient_sum", lambda *args: None)
    assert trace_training(module, sgd, step, batch) == traced  # no sum was made in place
    # the engine itself, no dispatch mode: the sum is none of the gradients the graph's nodes handed on
    a = module.weight * batch
    loss = uses(a).sum()
    made: set[int] = set()
    nodes, seen = [loss.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda inputs, _: made.update(g.data_ptr() for g in inputs if g is not None))
        nodes += [following for following, _ in node.next_functions]
    summed: list[int] = []
    a.register_hook(lambda g: summed.append(g.data_ptr()))
    loss.backward()
    assert summed[0] not in made


def test_a_sum_outside_backward_is_a_new_tensor():
    """Only autograd's sums are made in place: a forward's ``x * 2 + x`` under ``no_grad`` is a new tensor even
    where its first operand dies with it."""
    n = 1 << 16
    trace = trace_training(
        UsedTwice((n,), relu_and_sigmoid),
        sgd,
        lambda m, x: m(x).sum(),
        torch.ones(n),
        validate=lambda m, x: (x * 2) + x,
    )
    val = phases(trace.events)[-1][1]
    assert allocs(val) == [n * FLOAT] * 3  # the batch, the product, the sum


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, masked: bool = False, contiguous_kv: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.masked = masked
        self.contiguous_kv = (
            contiguous_kv  # as a cache that concatenates them (transformers' GPT-2) makes them
        )
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(dim, dim=2)
        )
        if self.contiguous_kv:
            k, v = k.contiguous(), v.contiguous()
        dropout = 0.1 if self.training else 0.0
        if self.masked:
            mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return y.transpose(1, 2).contiguous().view(batch, length, dim)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["memory-efficient", "flash"])
def test_attention_takes_the_fused_kernels_memory_not_the_math_path(dtype):
    batch, length, heads, dim = 2, 200, 4, 128
    trace = trace_training(
        Attention(dim, heads),
        sgd,
        lambda m, x: m(x).float().sum(),
        torch.randn(batch, length, dim),
        validate=lambda m, x: m(x),
        autocast_dtype=dtype,
    )
    cut = phases(trace.events)
    train, val = allocs(cut[1][1]), allocs(cut[-1][1])
    assert batch * heads * length * length * FLOAT not in train + val  # no attention matrix
    rows = length if dtype else 224  # memory-efficient attention pads its logsumexp to 32 rows
    assert batch * heads * rows * FLOAT in train
    if dtype:  # FlashAttention's backward: softmax_d and dq_accum, their rows rounded to 128
        assert batch * heads * 256 * FLOAT in train
        assert batch * 256 * heads * (dim // heads) * FLOAT in train
    # validation: flash's logsumexp even without gradients; memory-efficient attention's only with them
    assert (batch * heads * rows * FLOAT in val) == (dtype is not None)
    # the output is written (batch, length, heads, dim): transposing it back costs no copy
    element = 2 if dtype else FLOAT  # fp32: the batch and the output; bf16: the input cast and the output
    assert val.count(batch * length * dim * element) == 2


def test_attention_gradients_are_laid_out_like_their_inputs():
    """FlashAttention's and cuDNN's backward make each gradient ``empty_like`` its input: a key and value made
    contiguous (batch, heads, length, dim) get gradients laid out so, which the view's backward then copies."""
    batch, length, heads, dim = 2, 200, 4, 128

    def train_allocs(contiguous_kv: bool) -> list[int]:
        trace = trace_training(
            Attention(dim, heads, contiguous_kv=contiguous_kv),
            sgd,
            lambda m, x: m(x).float().sum(),
            torch.randn(batch, length, dim),
            autocast_dtype=torch.bfloat16,
        )
        return allocs(phases(trace.events)[1][1])

    # two copies in the forward, two in the backward
    activation = batch * length * dim * 2
    assert train_allocs(True).count(activation) == train_allocs(False).count(activation) + 4


def test_a_boolean_mask_becomes_a_padded_bias_kept_for_backward():
    batch, length, heads, dim = 2, 200, 4, 128
    trace = trace_training(
        Attention(dim, heads, masked=True), sgd, lambda m, x: m(x).sum(), torch.randn(batch, length, dim)
    )
    train = phases(trace.events)[1][1]
    blocks = {e.block: e.size for e in train if e.action == "alloc"}
    padded = [block for block, size in blocks.items() if size == length * 208 * FLOAT]  # rows padded to 16
    assert len(padded) == 1
    assert length * length * FLOAT in blocks.values()  # the bias before padding, freed at once
    assert batch * heads * 224 * FLOAT in blocks.values()  # memory-efficient attention's logsumexp
    seed = [i for i, e in enumerate(train) if e.action == "alloc" and e.size == FLOAT][1]  # backward starts
    assert train.index(Event("free", padded[0], length * 208 * FLOAT)) > seed  # saved for backward


def test_autocast_follows_cudas_lists_and_caches_weight_casts():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(256, 256)
            self.norm = nn.LayerNorm(256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.linear(self.linear(x)))

    def val_allocs(inference_mode: bool) -> list[int]:
        trace = trace_training(
            Net(),
            sgd,
            lambda m, x: m(x).sum(),
            torch.randn(16, 256),
            validate=lambda m, x: m(x),
            autocast_dtype=torch.bfloat16,
            inference_mode=inference_mode,
        )
        return allocs(phases(trace.events)[-1][1])

    val = val_allocs(inference_mode=False)
    # CUDA's autocast casts an op's arguments last first (linear: the bias, the weight, then the input)
    assert val[1:4] == [256 * 2, 256 * 256 * 2, 16 * 256 * 2]
    assert val.count(256 * 256 * 2) == 1  # the weight cast once for both calls
    assert val.count(16 * 256 * 2) == 3  # the input cast, two linear outputs: bfloat16
    assert val.count(16 * 256 * FLOAT) == 3  # the batch, the layer norm's input cast and output: float32
    with pytest.raises(ValueError, match=r"autocast_dtype=torch\.float32"):
        trace_training(Net(), sgd, mse, torch.randn(2, 256), autocast_dtype=torch.float32)
    # under torch.inference_mode() autocast keeps no cast: the weight is cast for each call
    assert val_allocs(inference_mode=True).count(256 * 256 * 2) == 2


def test_without_autocasts_cache_each_call_casts_the_weight_and_the_cast_dies_with_what_holds_it():
    """``torch.autocast(cache_enabled=False)``, as Lightning 2.6's bf16-mixed runs: a weight used twice is cast
    twice; in validation (no_grad) each cast dies with its call, where the cache keeps it to the region's end."""
    layer = nn.Linear(256, 256)

    def trace(cache: bool):
        return trace_training(
            layer,
            sgd,
            lambda m, x: m(m(x)).float().sum(),
            torch.randn(16, 256),
            validate=lambda m, x: m(m(x)),
            autocast_dtype=torch.bfloat16,
            autocast_cache=cache,
        )

    weight = 256 * 256 * 2
    for cache in (True, False):
        cut = phases(trace(cache).events)
        train, val = next(chunk for label, chunk in cut if label == "train"), cut[-1][1]
        casts = [e for e in train if e.size == weight][:3]
        if cache:  # validation: cast once, kept; training: the cast lives to the forward's end
            assert (allocs(val).count(weight), peak_count(val, weight)) == (1, 1)
            assert [e.action for e in casts] == ["alloc", "alloc", "free"]  # then the gradient, then it
        else:  # validation: cast for each call, one alive at a time; training: the first call's input needs
            # no gradient, so autograd does not keep its cast of the weight
            assert (allocs(val).count(weight), peak_count(val, weight)) == (2, 1)
            assert [e.action for e in casts] == ["alloc", "free", "alloc"]


def peak_count(events, size: int) -> int:
    """The most blocks of ``size`` alive at once."""
    alive = most = 0
    for event in events:
        if event.size == size and event.action in ("alloc", "free"):
            alive += 1 if event.action == "alloc" else -1
            most = max(most, alive)
    return most


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.first = nn.Linear(256, 256)
        self.block = nn.Sequential(nn.Linear(256, 1000), nn.GELU(), nn.Dropout(0.1), nn.Linear(1000, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.first(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpointed_forwards_are_recomputed_as_cuda_would(reentrant, dtype):
    trace = trace_training(
        Checkpointed(reentrant),
        sgd,
        lambda m, x: m(x).float().sum(),
        torch.randn(64, 256),
        autocast_dtype=dtype,
    )
    assert trace.cannot_trace is None  # the recomputed dropout's mask and casts match the forward's
    for label, chunk in phases(trace.events):
        if label == "train":  # the forward's dropout mask, and the recomputation's
            assert allocs(chunk).count(64 * 1000) == 2


class HardCodedCuda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0], device="cuda", dtype=torch.float32)  # allocated
        return self.linear(x.cuda().to("cuda")) + positions[:, None]  # moves that are no-ops on the GPU


def test_a_forward_that_names_the_gpu_is_traced_on_the_stand_in():
    trace = trace_training(HardCodedCuda(), sgd, lambda m, x: m(x).sum(), torch.randn(4, 8))
    assert trace.cannot_trace is None
    forward = allocs(phases(trace.events)[1][1])
    batch_copy, positions, linear, add = 4 * 8 * FLOAT, 4 * FLOAT, 4 * 8 * FLOAT, 4 * 8 * FLOAT
    assert forward[:4] == [batch_copy, positions, linear, add]  # no copies for the moves


def test_a_default_device_set_by_the_caller_does_not_leak_into_the_trace():
    def step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (module(batch) * torch.ones(batch.shape[1])).sum()  # made on the default device

    module = mlp()
    expected = trace_training(module, adamw, step, torch.randn(8, 1024))
    with torch.device("meta"):
        assert trace_training(module, adamw, step, torch.randn(8, 1024, device="cpu")) == expected


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"trace_training\(steps=0\)"):
        trace_training(mlp(), sgd, mse, torch.randn(2, 1024), steps=0)
    with pytest.raises(TypeError, match="make_optimizer=3"):
        trace_training(mlp(), 3, mse, torch.randn(2, 1024))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Expected the loss"):
        trace_training(mlp(), sgd, lambda m, x: None, torch.randn(2, 1024))


def test_cross_entropy_under_autocast_keeps_cudas_half_log_probabilities_and_casts_them_for_nll_loss():
    """On CUDA ``cross_entropy_loss`` is not an autocast-listed op: its ``log_softmax(input, dim, input.dtype)``
    stays bf16 (a dtype given: autocast leaves it), and the listed ``nll_loss`` casts that to float32. Measured
    on the 236M GPT of benchmarks/tuner.py: the trace's allocated peak at 40 is the H100's within 0.02%
    (benchmarks/results/traced-plan-cpu.json); a float32 cast of the logits first was 6% over."""
    batch, classes = 33, 1000  # sizes no weight shares
    net = nn.Linear(64, classes)

    def step(module, data):
        x, y = data
        return nn.functional.cross_entropy(module(x), y)

    data = (torch.zeros(batch, 64), torch.zeros(batch, dtype=torch.long))
    trace = trace_training(
        net, lambda ps: torch.optim.SGD(ps, lr=0.1), step, data, validate=step, autocast_dtype=torch.bfloat16
    )
    phases: dict[str, list[str]] = {}
    phase = ""
    for event in trace.events:
        if event.action == "mark":
            phase = event.label
        elif event.action == "alloc" and event.size in (batch * classes * 2, batch * classes * 4):
            phases.setdefault(phase, []).append("bf16" if event.size == batch * classes * 2 else "fp32")
    assert phases["val"] == ["bf16", "bf16", "fp32"]  # logits, log-probabilities, nll_loss's float32 cast


def test_a_dataclass_batch_is_copied_to_the_device_like_a_tuple():
    from dataclasses import dataclass

    @dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    net = nn.Linear(64, 8)

    def step(module, data):
        x, y = (data.x, data.y) if isinstance(data, Batch) else data
        return nn.functional.cross_entropy(module(x), y)

    x, y = torch.zeros(33, 64), torch.zeros(33, dtype=torch.long)
    sizes = {}
    for name, data in (("tuple", (x, y)), ("dataclass", Batch(x, y))):
        trace = trace_training(net, lambda ps: torch.optim.SGD(ps, lr=0.1), step, data)
        sizes[name] = [e.size for e in trace.events if e.action == "alloc"]
    assert sizes["dataclass"] == sizes["tuple"]
    assert 33 * 64 * 4 in sizes["dataclass"]  # the batch's own copy on the device


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_multihead_attention_inside_an_encoder_layer_takes_the_fused_kernel_and_cudas_casts(dtype):
    batch, length, dim, heads = 2, 200, 64, 4
    layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
    trace = trace_training(
        layer,
        sgd,
        lambda m, x: m(x).float().sum(),
        torch.randn(batch, length, dim),
        autocast_dtype=dtype,
    )
    train = allocs(phases(trace.events)[1][1])
    # F.multi_head_attention_forward's SDPA: no attention matrix (nor its dropout mask) on CUDA
    for element in (1, 2, FLOAT):
        assert batch * heads * length * length * element not in train
    rows = length if dtype else 224
    assert batch * heads * rows * FLOAT in train  # the fused kernel's logsumexp
    if dtype:  # its in-projection is cast: a bf16 (batch, length, 3 * dim) output
        assert batch * length * 3 * dim * 2 in train


def test_the_trace_names_the_attention_kernel_and_only_the_h100s_is_measured():
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(64, 192)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(x.shape[0], 16, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def ops(device: Device) -> frozenset[str]:
        trace = trace_training(
            Attend(), sgd, lambda m, x: m(x).float().mean(), torch.randn(2, 16, 64),
            autocast_dtype=torch.bfloat16, device=device,
        )  # fmt: skip
        return trace.ops

    assert "scaled_dot_product_attention (cudnn)" in ops(H100)
    assert "scaled_dot_product_attention (cudnn)" in MEASURED_OPS
    flash = ops(Device(attention="flash"))
    assert "scaled_dot_product_attention (flash)" in flash - MEASURED_OPS


# meta_first: the same steps on meta tensors (no fake mode), the fake tensors' trace where they fail


def _meta_cases() -> dict[str, Callable[[], _trace.Trace]]:
    def traced(module, make, step, batch, **kwargs):
        return lambda meta: trace_training(module, make, step, batch, meta_first=meta, **kwargs)

    encoder = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    return {
        "mlp-adamw": traced(mlp(), adamw, mse, torch.randn(8, 1024), validate=mse),
        "dropout": traced(
            nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1)),
            sgd,
            lambda m, x: m(x).sum(),
            torch.randn(8, 256),
        ),
        "attention-bf16": traced(
            Attention(128, 4),
            adamw,
            lambda m, x: m(x).float().sum(),
            torch.randn(2, 200, 128),
            validate=lambda m, x: m(x),
            autocast_dtype=torch.bfloat16,
        ),
        "masked-attention": traced(
            Attention(128, 4, masked=True), sgd, lambda m, x: m(x).sum(), torch.randn(2, 200, 128)
        ),
        "encoder-bf16": traced(
            encoder,
            adamw,
            lambda m, x: m(x).float().sum(),
            torch.randn(2, 64, 64),
            autocast_dtype=torch.bfloat16,
        ),
        "checkpointed": traced(
            Checkpointed(False),
            sgd,
            lambda m, x: m(x).float().sum(),
            torch.randn(64, 256),
            autocast_dtype=torch.bfloat16,
        ),
        "names-the-gpu": traced(HardCodedCuda(), sgd, lambda m, x: m(x).sum(), torch.randn(4, 8)),
    }


def _meta_checkpoints() -> bool:
    """Whether torch's activation checkpointing runs on meta tensors (torch 2.4's asks for ``torch.meta``)."""
    try:
        checkpoint(torch.sin, torch.empty(2, device="meta", requires_grad=True), use_reentrant=False)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("case", list(_meta_cases()))
def test_meta_first_traces_what_the_fake_tensors_trace_without_a_fake_mode(case, monkeypatch):
    run = _meta_cases()[case]
    fake = run(False)
    if case == "checkpointed" and not _meta_checkpoints():
        assert run(True) == fake  # the fake tensors' trace, as without meta_first
        return
    monkeypatch.setattr(_trace, "FakeTensorMode", None)  # meta tensors alone: no fake mode to fall back to
    meta = run(True)
    assert meta.cannot_trace is None
    assert fake.cannot_trace is None
    assert meta.events == fake.events
    assert meta.ops ^ fake.ops <= {"prim.device"}  # fake tensors dispatch `x.device`
    assert meta.unmeasured == fake.unmeasured


def test_meta_first_falls_back_to_fake_tensors_where_meta_ones_fail(monkeypatch):
    def mixes_a_host_tensor(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (module(batch) * torch.ones(batch.shape[1])).sum()  # meta and CPU do not mix

    def moves_to_the_host(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch).cpu().sum()  # no data to copy out of a meta tensor

    for step in (mixes_a_host_tensor, moves_to_the_host):
        fake = trace_training(mlp(), adamw, step, torch.randn(8, 1024))
        assert fake.cannot_trace is None
        assert trace_training(mlp(), adamw, step, torch.randn(8, 1024), meta_first=True) == fake
        with monkeypatch.context() as patched:  # meta tensors alone fail: the trace above is the fallback's
            patched.setattr(_trace, "FakeTensorMode", None)
            with pytest.raises(TypeError):
                trace_training(mlp(), adamw, step, torch.randn(8, 1024), meta_first=True)
    module = nn.Sequential(nn.Linear(8, 8), nn.Sequential(ItemInForward()))
    data_dependent = trace_training(module, sgd, lambda m, x: m(x).sum(), torch.randn(2, 8), meta_first=True)
    assert data_dependent.cannot_trace == "cannot trace: aten._local_scalar_dense at `1.0` (ItemInForward)"


def test_meta_first_raises_the_steps_own_error_as_the_fake_trace_does():
    def wrong_shape(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch[:, :7]).sum()

    for meta_first in (False, True):
        with pytest.raises(RuntimeError, match="same reduction dim"):
            trace_training(nn.Linear(8, 8), sgd, wrong_shape, torch.randn(2, 8), meta_first=meta_first)

"""The buffers CUDA's kernels ask the allocator for themselves, in the trace, against the H100's own histories."""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.kernels import EMBEDDING_PART, H100, Device, reduce_buffers
from lightning_gpumem._hw.trace import trace_training
from lightning_gpumem.tuning.sources.allocator import replay
from lightning_gpumem.tuning.sources.traced import TracedSource
from tests.helpers.benchmark_gpt import gpt_tracer

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
STREAMS = ROOT / "benchmarks" / "results" / "allocator-streams-h100"
A100 = Device(multiprocessors=108)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def linear_step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).float().square().mean()


def backward_events(events: list[Event]) -> list[Event]:
    """The first step's events after its forward (the kernels' buffers of the backward among them)."""
    first = events[: next(i for i, e in enumerate(events) if e.action == "mark" and e.label == "optimizer")]
    return [e for e in first if e.kernel]


@pytest.mark.parametrize(("device", "staged"), [(H100, 132 * MIB), (A100, 108 * MIB)], ids=["H100", "A100"])
def test_a_bias_gradient_over_many_tokens_stages_its_partial_sums_by_the_cards_multiprocessors(
    device, staged
):
    trace = trace_training(
        nn.Linear(1024, 4096),
        sgd,
        linear_step,
        torch.zeros(20480, 1024),
        autocast_dtype=torch.bfloat16,
        device=device,
    )
    scratch = [e for e in backward_events(trace.events) if e.size >= MIB]
    # the bias gradient (4096 outputs, 20480 inputs each): allocated after its output, freed at once
    assert [(e.action, e.size) for e in scratch] == [("alloc", staged), ("free", staged)]
    assert staged == reduce_buffers((20480, 4096), (4096, 1), (0,), 4, device)[0]


def test_a_reduction_too_short_to_split_asks_for_nothing_but_keeps_its_place_in_the_stream():
    small, large = (
        trace_training(nn.Linear(64, 64), sgd, linear_step, torch.zeros(rows, 64)).events
        for rows in (8, 65536)
    )
    kernels = [[e for e in events if e.kernel] for events in (small, large)]
    assert len(kernels[0]) == len(kernels[1]) > 0  # the same requests at both sizes
    assert {e.size for e in kernels[0]} == {0}  # 8 rows: no staging buffer, no request to the allocator
    assert max(e.size for e in kernels[1]) > 0


def test_the_first_matrix_multiply_of_each_thread_keeps_its_cublas_workspaces():
    trace = trace_training(nn.Linear(64, 64), sgd, linear_step, torch.zeros(8, 64), steps=2)
    kept = [e.size for e in trace.events if e.action == "alloc" and e.size >= MIB]
    # the forward's first matrix multiply, then the backward's (autograd's thread); none at the second step
    assert kept == [*H100.forward_workspaces, *H100.backward_workspaces]
    freed = {e.block for e in trace.events if e.action == "free"}
    assert not freed & {e.block for e in trace.events if e.action == "alloc" and e.size >= MIB}


def test_streams_made_past_where_the_buffers_stop_growing_are_the_traced_ones():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    def trace_at(size: int):
        return trace_training(module, sgd, linear_step, torch.zeros(size, 256))

    source = TracedSource(trace_at)
    for size in (2048, 4096, 8192):  # the staging buffers grow with the rows here
        source.replay(size)
    assert source.affine.state == "on"
    made = source.affine.at(65536)  # past 16,896 rows they stop growing: a recipe, not a line, says so
    assert made is not None
    assert made == TracedSource(trace_at, synthesise=False)._trace(65536)


# --------------------------------------------------------------------- the 236M GPT against its H100 history
def _history(size: int, workload: str = "gpt") -> tuple[list[Event], dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from allocator_fidelity import replayable

    with gzip.open(STREAMS / f"{workload}-b{size}-native-capped.json.gz", "rt") as file:
        data = json.load(file)
    return replayable(Event, data)[0], data


def _train_and_val(events: list[Event]) -> tuple[list[Event], list[Event]]:
    """The first training step's events and the validation's."""
    marks = [i for i, e in enumerate(events) if e.action == "mark"]
    return events[marks[0] + 1 : marks[1]], events[marks[-1] + 1 :]


def _reduction(event: Event) -> bool:
    return bool(event.kernel) and event.kernel[0] < EMBEDDING_PART


def _first_step(events: list[Event]) -> list[Event]:
    """The requests of the first training step (forward, backward), in order."""
    start = next(i for i, e in enumerate(events) if e.action == "mark" and e.label in ("train", "forward"))
    end = next(i for i, e in enumerate(events) if e.action == "mark" and e.label == "optimizer")
    return [e for e in events[start:end] if e.action == "alloc"]


@pytest.fixture(scope="module")
def gpt_trace():
    return gpt_tracer(steps=2, lightning=False)  # as benchmarks/allocator_fidelity.py ran it


def _scratch_sizes(events: list[Event]) -> Counter:
    """The training steps' requests of 1 MiB or more freed at once (within four events): the kernels' buffers
    among them."""
    born, sizes, found = {}, {}, Counter()
    for at, event in enumerate(events):
        if event.action == "mark" and event.label in ("val", "validation"):
            break
        if event.action == "alloc":
            born[event.block], sizes[event.block] = at, event.size
        elif event.action == "free" and at - born.get(event.block, -9) <= 4 and sizes[event.block] >= MIB:
            found[sizes[event.block]] += 1
    return found


@pytest.mark.parametrize("size", [8, 40])
def test_the_gpts_trace_is_the_h100s_history(gpt_trace, size):
    """The 236M GPT of benchmarks/tuner.py, bf16, 24 GiB cap (benchmarks/allocator_fidelity.py --gpt 8,40)."""
    real, data = _history(size)
    traced = gpt_trace(size).events
    # the reductions' staging buffers: 32, 96 and 128 MiB at 4,096 tokens, 132 MiB at 20,480, as many as the H100's
    staged = Counter(e.size for e in traced if _reduction(e) and e.action == "alloc" and e.size >= MIB)
    assert set(staged) == ({32 * MIB, 96 * MIB, 128 * MIB} if size == 8 else {132 * MIB})
    assert {s: _scratch_sizes(real)[s] for s in staged} == staged
    real_peaks, traced_peaks = replay(real), replay(traced)
    assert traced_peaks.peak_allocated == real_peaks.peak_allocated
    assert traced_peaks.peak_reserved == real_peaks.peak_reserved
    capped = replay(traced, limit_bytes=data["limit_bytes"])
    assert capped.fits  # the H100 ran it under the cap
    assert capped.peak_reserved == replay(real, limit_bytes=data["limit_bytes"]).peak_reserved


def test_hugging_face_gpt2s_trace_is_the_h100s_history():
    """transformers' GPT2LMHeadModel (GPT-2 medium, bf16, cuDNN's attention) at 13 under 24 GiB, the largest
    size the H100 ran, with 0.27% of the cap to spare: its requests and peaks are the H100's."""
    pytest.importorskip("transformers")
    real, data = _history(13, "hf-gpt2")
    traced = gpt_tracer(steps=2, lightning=False, workload="hf-gpt2")(13).events
    large = [
        Counter(e.size for e in side if e.action == "alloc" and e.size >= MIB) for side in (real, traced)
    ]
    assert large[0] == large[1]  # the embedding backward's partial sums among them
    cap = data["limit_bytes"]
    real_peaks, traced_peaks = replay(real, limit_bytes=cap), replay(traced, limit_bytes=cap)
    assert traced_peaks.fits
    assert traced_peaks.peak_reserved == real_peaks.peak_reserved
    assert traced_peaks.peak_allocated == real_peaks.peak_allocated


@pytest.mark.parametrize(("workload", "size"), [("hf-gpt2", 13), ("gpt-ckpt", 79)])
def test_the_embedding_backwards_buffers_are_the_h100s_in_its_order(workload, size):
    """The token embedding's backward (non-contiguous indices, more than 3,072): its 15 buffers, in the order the
    H100 asked for them, around its output; the position embedding's (512 indices) asks for none."""
    if workload == "hf-gpt2":
        pytest.importorskip("transformers")
    real, _ = _history(size, workload)
    traced = gpt_tracer(steps=2, lightning=False, workload=workload)(size).events
    first_step = [e for e in _first_step(traced) if e.kernel and e.kernel[0] >= EMBEDDING_PART]
    assert len(first_step) == 30  # two embeddings, 15 buffers each
    made = [e.size for e in first_step if e.size]
    assert len(made) == 15
    real_sizes = [e.size for e in _first_step(real)]
    end = real_sizes.index(made[-1])  # the partial sums, the largest, last
    window = real_sizes[end - 15 : end + 1]
    vocabulary = 50257 if workload == "hf-gpt2" else 32768
    assert window[5] == vocabulary * 1024 * 4  # the weight's gradient (float32), after the sort's buffers
    assert window[:5] + window[6:] == made


def test_cudnn_attention_keeps_no_statistics_without_a_backward_and_asks_256_bytes_more_in_it():
    """cuDNN's attention (the H100's, torch 2.11): its logsumexp only where gradients are needed; its backward's
    workspace FlashAttention's two buffers and 256 bytes (85196800 + 256 in the GPT's history at 40)."""
    batch, length, heads, dim = 40, 512, 16, 1024
    _, data = _history(40)
    recorded = Counter(item[2] for item in data["events"] if item[0] == "a")
    softmax_d, accum = batch * heads * length, batch * length * heads * (dim // heads)
    assert recorded[4 * (softmax_d + accum) + 256] == 32  # 16 layers, two steps
    sys.path.insert(0, str(ROOT / "tests" / "hw"))
    from test_trace import Attention

    torch.manual_seed(0)
    trace = trace_training(
        Attention(64, 4),
        sgd,
        lambda m, x: m(x).float().sum(),
        torch.randn(2, 128, 64),
        validate=lambda m, x: m(x),
        autocast_dtype=torch.bfloat16,
        device=H100,
    )
    train, val = ([e.size for e in chunk if e.action == "alloc"] for chunk in _train_and_val(trace.events))
    logsumexp = 2 * 4 * 128 * 4
    assert logsumexp in train
    assert logsumexp not in val
    assert 4 * (2 * 4 * 128 + 2 * 128 * 4 * 32) + 256 in train


def test_the_gpt_that_ran_out_of_memory_on_the_h100_does_not_fit_the_trace(gpt_trace):
    _, data = _history(41)
    assert data["oom"]
    assert not replay(gpt_trace(41).events, limit_bytes=data["limit_bytes"]).fits


def test_the_long_validation_the_h100s_plain_loop_ran_out_of_memory_in_does_not_fit_its_plain_trace():
    """The 4096-token validation at 19, as a plain loop runs it (gradients kept, ``no_grad``): out of memory in
    validation on the H100 and in the replay; as Lightning runs it (gradients freed, inference mode), it fits."""
    real, data = _history(19, "gpt-longval")
    assert data["oom"]
    assert "validation" in data["real_phase_peaks"]
    plain = gpt_tracer(steps=2, lightning=False, workload="gpt-longval")(19).events
    replayed = replay(plain, limit_bytes=data["limit_bytes"])
    assert not replayed.fits
    assert replay(plain).phase_peaks["train"][0] == pytest.approx(
        replay(real).phase_peaks["forward"][0], rel=0.001
    )
    lightning = gpt_tracer(steps=2, workload="gpt-longval")(19).events
    assert replay(lightning, limit_bytes=data["limit_bytes"]).fits


LM_STREAMS = ROOT / "benchmarks" / "results" / "traced-lm-h100"


def _lm_stream(batch: int) -> dict:
    with gzip.open(LM_STREAMS / f"tiny-b{batch}-fp32.json.gz", "rt", encoding="utf-8") as file:
        return json.load(file)


@pytest.mark.parametrize(
    ("shape", "strides", "dims", "staged", "semaphores"),
    [
        ((1024, 8192), (8192, 1), (0,), 64 * MIB, 256),  # the vocabulary head's bias gradient, 1024 tokens
        ((1024, 2048), (2048, 1), (0,), 16 * MIB, 64),  # the feed-forward's first bias
        ((256, 4, 1536), (6144, 1536, 1), (0, 1), 12 * MIB, 48),  # the attention's packed input bias
    ],
)
def test_a_reduction_over_fewer_tokens_than_features_stages_as_on_the_h100(
    shape, strides, dims, staged, semaphores
):
    # fewer reduced than kept values: the reduced dimensions are still not the fastest moving ones
    assert reduce_buffers(shape, strides, dims, 4) == (staged, semaphores)
    allocs = Counter(item[2] for item in _lm_stream(4)["events"] if item[0] == "a")
    assert allocs[staged] >= 3  # once a training step, in the H100's history
    assert allocs[semaphores] >= 3


@pytest.mark.parametrize("batch", [4, 16])
def test_the_small_language_models_trace_reserves_what_the_h100_reserved(batch):
    sys.path.insert(0, str(ROOT))
    from benchmarks.traced_lm_streams import traced_peaks

    reserved, allocated = traced_peaks(batch)
    real = _lm_stream(batch)
    assert reserved == real["reserved"]
    assert abs(allocated / real["allocated"] - 1) < 0.005


def test_the_checkpointed_gpts_traced_plan_under_24_gib_is_not_above_what_the_h100_ran():
    """``benchmarks/tuner.py --models gpt-ckpt --true-max fit`` on the H100 (truth-24gib-gpt-ckpt-h100.json)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from traced_plan import run

    truth = json.loads((ROOT / "benchmarks" / "results" / "truth-24gib-gpt-ckpt-h100.json").read_text())
    true_max = truth["workloads"]["gpt-ckpt"]["true_max"]["true_max"]
    assert true_max == 79
    planned = run("gpt-ckpt", [24.0], None, {}, quick=False)["cells"][0]["largest"]  # the planner's margin
    assert 0.97 * true_max <= planned <= true_max


@pytest.mark.parametrize(("size", "fits"), [(78, True), (79, True), (80, False)])
def test_the_checkpointed_gpts_lightning_fit_is_the_h100s(size, fits):
    """The 4-step Lightning fit (bf16-mixed: autocast without its cache of weight casts, so under activation
    checkpointing each cast dies in its layer) as the H100 ran it under 24 GiB
    (``allocator_fidelity.py --lightning --steps 4``): 78 and 79 ran, 80 ran out of memory in its third step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from allocator_fidelity import replayable

    with gzip.open(STREAMS / f"gpt-ckpt-fit-b{size}-native-capped.json.gz", "rt") as file:
        data = json.load(file)
    real = replayable(Event, data)[0]
    assert data["lightning"]
    assert data["steps"] == 4
    traced = gpt_tracer(steps=4, lightning=True, workload="gpt-ckpt")(size).events
    cap = data["limit_bytes"]
    real_peaks, traced_peaks = replay(real, limit_bytes=cap), replay(traced, limit_bytes=cap)
    assert real_peaks.fits == traced_peaks.fits == fits
    assert traced_peaks.peak_reserved == pytest.approx(real_peaks.peak_reserved, rel=2e-4)


@pytest.mark.parametrize(
    ("workload", "result", "size"),
    [
        ("gpt", "truth-48gib-gpt-12steps-h100.json", 86),
        ("gpt", "truth-48gib-gpt-12steps-h100.json", 87),
        ("gpt-ckpt", "truth-24gib-ckpt-12steps-h100.json", 77),
        ("gpt-ckpt", "truth-24gib-ckpt-12steps-h100.json", 78),
        ("gpt-ckpt", "truth-24gib-ckpt-12steps-h100.json", 85),
    ],
)
def test_the_steady_replay_runs_out_of_memory_in_the_step_the_h100s_12_step_fit_did(workload, result, size):
    """The H100's 12-step Lightning fits (``TRUTH_STEPS=12 ... gpu_session.sh truth``): the GPT under 48 GiB ran
    86 and ran out of memory at 87 after 7 steps (its 4-step fit ran); the checkpointed GPT under 24 GiB ran 77
    and 85 and ran out at 78 after 8 steps. The trace (3 steps, as the plan's), its last step repeated until the
    allocator's layout settles, fails in the same step and fits where the H100 ran 12."""
    from lightning_gpumem.tuning.sources.steps import replay_steady

    data = json.loads((ROOT / "benchmarks" / "results" / result).read_text())
    assert data["settings"]["fit_steps"] == 12
    probe = next(p for p in data["workloads"][workload]["true_max"]["probes"] if p["batch_size"] == size)
    events = gpt_tracer(steps=3, lightning=True, workload=workload)(size).events
    replayed, steps = replay_steady(events, limit_bytes=data["settings"]["budget_bytes"], max_steps=12)
    assert replayed.fits == probe["ok"]
    if not probe["ok"]:
        assert steps == probe["steps"] + 1  # the steps it ran, and the one that ran out of memory

"""BatchSizeTuner on variable-length data: the longest samples first (``length_fn``), a warning without it, and the
token budget of a ``TokenBudgetSampler``. CPU: a simulated OOM above a number of padded tokens per batch."""

from __future__ import annotations

import math
import random
import warnings

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from lightning_gpumem import BatchSizeTuner, TokenBudgetSampler
from lightning_gpumem.tuning.lengths.scan import sample_length, scan_lengths
from tests.helpers.tuning import Texts, pad, tuner_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
    pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
]


SEARCH = 10**9
"""A ``max_val`` that bounds nothing: on the CPU the tuner searches only where ``max_val`` is given (else it keeps the
size), and the search is then bounded by the dataset as it was without one."""


def skewed_lengths(n: int = 600, seed: int = 0) -> list[int]:
    """Mostly 4 to 32 tokens, and eight samples of 256."""
    rng = random.Random(seed)
    lengths = [rng.randint(4, 32) for _ in range(n)]
    for index in rng.sample(range(n), 8):
        lengths[index] = 256
    return lengths


class TextModel(LightningModule):
    """Runs out of (simulated) memory where a batch holds more than ``limit`` padded tokens (``val_limit`` in
    validation); records the padded tokens of every batch it ran."""

    def __init__(
        self, lengths: list[int], limit: int = 4096, val_limit: int | None = None, batch_size: int = 2
    ):
        super().__init__()
        self.lengths, self.limit, self.val_limit = lengths, limit, val_limit or limit
        self.batch_size = batch_size
        self.max_tokens = 0  # for the token budget's tests
        self.layer = torch.nn.Embedding(2, 4)
        self.seen: list[int] = []

    def step(self, batch: torch.Tensor, limit: int) -> torch.Tensor:
        if batch.numel() > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated: too many padded tokens)")
        return self.layer(batch).sum()

    def on_train_start(self):
        self.seen = []  # the fit's batches, not the trials' (which skip this hook)

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.numel())
        return self.step(batch, self.limit)

    def validation_step(self, batch, batch_idx):
        self.step(batch, self.val_limit)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Texts(self.lengths), batch_size=self.batch_size, shuffle=True, collate_fn=pad)

    def val_dataloader(self):
        return DataLoader(Texts(self.lengths[:200]), batch_size=self.batch_size, collate_fn=pad)


def test_length_fn_tunes_for_the_longest_batch_and_the_whole_epoch_runs():
    lengths = skewed_lengths()
    model = TextModel(lengths)
    tuner = BatchSizeTuner(length_fn="input_ids", max_val=SEARCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "changed shape" warning: the trials ran the longest
        warnings.filterwarnings("ignore", ".*does not have many workers")
        warnings.filterwarnings("ignore", ".*stopped at the upper bound")
        tuner_trainer(tuner).fit(model)
    assert tuner.optimal_batch_size == model.batch_size == 16  # 16 x 256 = 4096 tokens, the limit
    assert max(model.seen) <= 4096  # a full shuffled epoch: every batch fitted
    assert len(model.seen) == -(-len(lengths) // 16)


def test_a_key_a_function_and_an_attribute_measure_the_same_length():
    sample = {"input_ids": torch.ones(7)}
    assert sample_length(sample, "input_ids") == sample_length(sample, lambda s: len(s["input_ids"])) == 7
    assert sample_length(torch.ones(5, 3), len) == 5
    assert sample_length({"n": torch.tensor(9)}, "n") == 9


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (True, TypeError), (object(), TypeError)])
def test_a_length_fn_giving_no_length_is_refused(value, error):
    with pytest.raises(error, match="length_fn"):
        sample_length({}, lambda s: value)


def test_a_scan_past_its_time_limit_keeps_the_samples_scanned():
    found = scan_lengths(list(range(1000)), lambda s: s, max_seconds=0.0)
    assert found.scanned == 64  # it looks at the clock every 64 samples
    assert not found.complete
    assert found.order[:64] == sorted(found.order[:64], key=lambda i: -i)
    assert sorted(found.order) == list(range(1000))


def test_without_length_fn_batches_that_change_shape_are_named_in_a_warning():
    model = TextModel(skewed_lengths(), limit=10**9)
    tuner = BatchSizeTuner(max_val=SEARCH)
    with pytest.warns(UserWarning, match=r"changed shape .*Pass `length_fn`"):
        tuner_trainer(tuner, max_steps=1).fit(model)


def test_a_key_the_samples_lack_is_named_and_the_users_error_reaches_the_user():
    model = TextModel(skewed_lengths())
    with pytest.raises(
        ValueError, match=r"`length_fn='tokens'` found no key 'tokens' in .*keys 'input_ids'"
    ) as info:
        tuner_trainer(BatchSizeTuner(length_fn="tokens", max_val=8), max_steps=1).fit(model)
    assert isinstance(info.value.__cause__, KeyError)  # the lookup's own error, chained
    assert model.batch_size == 2  # the original size is back


class Measured(TextModel):
    """Samples carry their length in ``"n"``: a numpy integer, except sample ``BAD``'s, which is ``bad``."""

    BAD = 100  # not among the 8 samples a dataset is told apart by (0, 85, 171, ...): the scan finds it

    def __init__(self, bad: object, **kwargs) -> None:
        super().__init__(skewed_lengths(), **kwargs)
        self.bad = bad

    def train_dataloader(self):
        lengths, bad, at = self.lengths, self.bad, self.BAD

        class Lengths(Texts):
            def __getitem__(self, index: int) -> dict:
                return {**super().__getitem__(index), "n": bad if index == at else np.int64(lengths[index])}

        return DataLoader(Lengths(lengths), batch_size=self.batch_size, shuffle=True, collate_fn=pad)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (np.float64("nan"), TypeError),
        (torch.tensor(float("inf")), TypeError),
        (np.float64(3.7), TypeError),  # was taken as 3
        (np.int64(-4), ValueError),
        (2**64, ValueError),
        ("long", TypeError),
        (None, TypeError),
    ],
    ids=repr,
)
def test_a_bad_length_in_a_real_fit_is_named_with_its_sample_and_value(bad, error):
    model = Measured(bad)
    with pytest.raises(error) as info:
        tuner_trainer(BatchSizeTuner(length_fn="n", max_val=8), max_steps=1, limit_val_batches=0).fit(model)
    message = str(info.value)
    assert message.startswith(f"`length_fn='n'` gave {bad!r} (type {type(bad).__name__}) for sample 100"), (
        message
    )
    assert "Expected a whole number from 0 to 2**53" in message
    assert model.batch_size == 2  # the original size is back


class LengthError(Exception):
    """The user's own error, raised by their ``length_fn``."""


def test_a_length_fn_that_raises_reaches_the_user_unchanged_with_a_note():
    def length_of(sample):
        if sample["n"] == 0:
            raise LengthError("no tokens counted")
        return sample["n"]

    model = Measured(np.int64(0))
    with pytest.raises(
        LengthError, match="no tokens counted"
    ) as info:  # the user's own error, not one of ours
        tuner_trainer(BatchSizeTuner(length_fn=length_of, max_val=8), max_steps=1, limit_val_batches=0).fit(
            model
        )
    assert "`length_fn=length_of` for sample 100" in info.value.__notes__[0]
    assert model.batch_size == 2


@pytest.mark.parametrize("length_fn", [5, "", b"x"])
def test_a_bad_length_fn_is_named(length_fn):
    with pytest.raises(TypeError, match=r"length_fn="):
        BatchSizeTuner(length_fn=length_fn)


# ---------------------------------------------------------------------- token budget
class TokenModel(TextModel):
    def train_dataloader(self):
        sampler = TokenBudgetSampler(self.lengths, max_tokens=self.max_tokens, seed=1)
        return DataLoader(Texts(self.lengths), batch_sampler=sampler, collate_fn=pad)

    def val_dataloader(self):
        sampler = TokenBudgetSampler(self.lengths[:200], max_tokens=self.max_tokens, shuffle=False)
        return DataLoader(Texts(self.lengths[:200]), batch_sampler=sampler, collate_fn=pad)


def test_a_token_budget_is_tuned_on_the_heaviest_batches_and_the_epoch_stays_under_it():
    lengths = skewed_lengths()
    model = TokenModel(lengths, limit=6000)
    model.max_tokens = 512
    tuner = BatchSizeTuner(batch_arg_name="max_tokens", headroom=0.0, max_val=SEARCH)
    tuner_trainer(tuner).fit(model)
    assert tuner.optimal_batch_size >= 0.98 * 6000  # the search closes to within 1% on CPU
    assert model.max_tokens == tuner.optimal_batch_size
    assert max(model.seen) <= 6000  # every batch fitted
    assert sum(model.seen) >= sum(lengths)  # a whole epoch
    assert tuner.trials[0].batch_size == 256  # the first budget tried holds the longest sample alone


def test_a_token_budget_below_the_longest_sample_is_refused():
    model = TokenModel(skewed_lengths())
    model.max_tokens = 512
    with pytest.raises(ValueError, match=r"max_val=100.*longest sample alone \(256\)"):
        tuner_trainer(BatchSizeTuner(batch_arg_name="max_tokens", max_val=100)).fit(model)


def test_where_the_longest_sample_alone_runs_out_of_memory_the_tuner_says_so_and_tries_no_smaller_budget():
    model = TokenModel(skewed_lengths(), limit=200)  # the longest sample costs 256 padded tokens
    model.max_tokens = 512
    tuner = BatchSizeTuner(batch_arg_name="max_tokens", max_val=SEARCH)
    with pytest.raises(
        RuntimeError, match=r"even max_tokens=256 \(the longest sample's cost alone\) does not fit"
    ):
        tuner_trainer(tuner).fit(model)
    assert [t.batch_size for t in tuner.trials] == [256]  # no budget below it: its sampler refuses one


def test_a_first_budget_above_what_fits_searches_down_to_the_longest_samples_cost():
    model = TokenModel(skewed_lengths(), limit=300)  # the longest sample costs 256 padded tokens
    model.max_tokens = 512
    tuner = BatchSizeTuner(batch_arg_name="max_tokens", headroom=0.0, init_val=4096, max_val=SEARCH)
    tuner_trainer(tuner).fit(model)
    assert tuner.trials[0].batch_size == 4096
    assert 297 <= model.max_tokens == tuner.optimal_batch_size <= 300  # the search closes to within 1%
    assert min(t.batch_size for t in tuner.trials) >= 256


@pytest.mark.parametrize("limit", [256, 258, 300])
def test_near_the_longest_sample_the_headroom_keeps_no_budget_below_it(limit):
    model = TokenModel(skewed_lengths(), limit=limit)
    model.max_tokens = 512
    tuner = BatchSizeTuner(batch_arg_name="max_tokens", headroom=0.2, max_val=SEARCH)
    tuner_trainer(tuner).fit(model)
    assert min(t.batch_size for t in tuner.trials) == 256
    assert model.max_tokens == tuner.optimal_batch_size == max(256, math.ceil(0.8 * limit))


def test_the_tuned_budget_and_its_padding_are_logged(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers.fakes import read_csv_metrics

    lengths = skewed_lengths()
    model = TokenModel(lengths, limit=6000)
    model.max_tokens = 512
    tuner = BatchSizeTuner(batch_arg_name="max_tokens", max_val=SEARCH)
    tuner_trainer(tuner, logger=CSVLogger(tmp_path, name="run", version=0), max_steps=2).fit(model)
    logged = {
        key: float(value)
        for row in read_csv_metrics(tmp_path / "run" / "version_0")
        for key, value in row.items()
        if value
    }
    assert logged["gpumem/token_budget"] == logged["gpumem/batch_size"] == model.max_tokens
    expected = TokenBudgetSampler(lengths, max_tokens=model.max_tokens, seed=1).padding_fraction()
    assert logged["gpumem/padding_fraction"] == pytest.approx(100 * expected)


def test_length_fn_draws_only_the_samples_the_loaders_own_sampler_yields():
    from torch.utils.data import SubsetRandomSampler

    lengths = skewed_lengths()
    keep = [i for i, n in enumerate(lengths) if n <= 32]  # the 256-long samples are not in this split

    class Split(TextModel):
        def training_step(self, batch, batch_idx):
            if batch.shape[1] > 64:
                raise IndexError(
                    f"a sequence of {batch.shape[1]} tokens: longer than the model's 64 positions"
                )
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            return DataLoader(Texts(self.lengths), batch_size=self.batch_size, sampler=SubsetRandomSampler(keep),
                              collate_fn=pad)  # fmt: skip

    model = Split(lengths)
    tuner_trainer(BatchSizeTuner(length_fn="input_ids", max_val=SEARCH), limit_val_batches=0).fit(model)
    assert (
        0.95 * 128 <= model.batch_size <= 4096 // 32
    )  # the split's longest samples, 32 tokens, bound the size


def test_a_token_budget_leaves_the_epoch_the_batches_val_check_interval_needs():
    model = TokenModel(skewed_lengths(), limit=6000)
    model.max_tokens = 512
    trainer = tuner_trainer(
        BatchSizeTuner(batch_arg_name="max_tokens", max_val=SEARCH), val_check_interval=5
    )
    trainer.fit(model)  # a budget whose epoch has fewer than 5 batches would make Lightning refuse the fit
    assert len(model.seen) >= 5


def test_a_resumed_token_budget_logs_its_keys_again(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers.fakes import read_csv_metrics

    lengths = skewed_lengths()
    first = TokenModel(lengths, limit=6000)
    first.max_tokens = 512
    trainer = tuner_trainer(BatchSizeTuner(batch_arg_name="max_tokens", max_val=SEARCH), max_steps=2)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed = TokenModel(lengths, limit=6000)
    resumed.max_tokens = 512
    logger = CSVLogger(tmp_path, name="resumed", version=0)
    tuner = BatchSizeTuner(batch_arg_name="max_tokens", max_val=SEARCH)
    tuner_trainer(tuner, logger=logger, max_epochs=2).fit(resumed, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.max_tokens == first.max_tokens
    logged = {key for row in read_csv_metrics(tmp_path / "resumed") for key, value in row.items() if value}
    assert {"gpumem/token_budget", "gpumem/padding_fraction"} <= logged


# ---------------------------------------------------------------------- shape margin (fragmentation)
class CappedTokens(TokenModel):
    """Needs ``per_token`` bytes of the fake allocator per padded token of a batch, over its cap: OOM."""

    def __init__(self, probe, per_token: int, **kwargs) -> None:
        super().__init__(skewed_lengths(), **kwargs)
        self.fake, self.per_token = probe, per_token

    def step(self, batch: torch.Tensor, limit: int) -> torch.Tensor:
        need = batch.numel() * self.per_token
        if self.fake.allocated + need > self.fake.cap:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake allocator)")
        self.fake.spike(need)
        return self.layer(batch).sum()


class CappedTexts(CappedTokens):
    def train_dataloader(self):
        return TextModel.train_dataloader(self)

    def val_dataloader(self):
        return TextModel.val_dataloader(self)


@pytest.mark.parametrize(
    ("mode", "env", "shape_margin", "margin"),
    [
        (
            "tokens",
            "",
            None,
            0.2,
        ),  # PyTorch's default allocator: a fifth of the budget left for fragmentation
        ("tokens", "expandable_segments:True", None, 0.06),
        ("length_fn", "max_split_size_mb:64,expandable_segments:True", None, 0.06),
        ("length_fn", "", None, 0.2),
        ("tokens", "", 0.1, 0.1),  # the user's own
        # neither: the tuner cannot know that shapes vary before the trials: the whole budget (and a warning after)
        pytest.param("plain", "", None, 0.0, marks=pytest.mark.filterwarnings("ignore:.*changed shape")),
    ],
)
def test_trials_leave_a_margin_of_the_budget_where_shapes_vary(monkeypatch, mode, env, shape_margin, margin):
    from lightning_gpumem._core.units import GIB, MIB
    from tests.helpers.tuning import CappedFakeProbe, FakeTuner

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    per_token = MIB
    model = (CappedTokens if mode == "tokens" else CappedTexts)(probe, per_token)
    model.max_tokens = 512
    arguments = {"batch_arg_name": "max_tokens"} if mode == "tokens" else {}
    if mode == "length_fn":
        arguments["length_fn"] = "input_ids"
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.0, shape_margin=shape_margin, **arguments)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert probe.fractions[0] == pytest.approx((1 - margin) * 24 / 80)  # the trials' cap
    assert probe.fractions[-1] == 1.0  # the fit's own, put back
    held = (1 - margin) * 24 * GIB - 2 * GIB  # what a batch may take under the trials' cap
    if mode == "plain":
        return
    fitted = [t.peak_bytes for t in tuner.trials if t.fits]
    assert max(fitted) <= 2 * GIB + held  # no trial ran past the trials' cap
    value = tuner.optimal_batch_size
    if mode == "length_fn":  # the padded tokens of the heaviest batch, and of one 5% larger
        worst, larger = 256 * value, 256 * math.ceil(1.05 * value)
    else:  # a token budget: its costliest batch (the data may make none as costly as the budget itself)
        sampler = tuner.searched.tokens
        worst, larger = sampler.worst_cost(value), sampler.worst_cost(math.ceil(1.05 * value))
    assert worst * per_token <= held < (larger + 256) * per_token  # close under it: 5% more would not fit


def test_shape_margin_is_checked():
    for bad in (-0.1, 1.0, True, "0.2"):
        with pytest.raises(
            ValueError, match=rf"shape_margin={bad!r}.*Expected None or a number in \[0, 1\)"
        ):
            BatchSizeTuner(shape_margin=bad)


def test_the_budget_tuned_for_is_logged_and_restored_on_resume(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gpumem._core.units import GIB, MIB
    from tests.helpers.fakes import read_csv_metrics
    from tests.helpers.tuning import CappedFakeProbe, FakeTuner

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)

    def fit(name: str, ckpt_path=None) -> FakeTuner:
        probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
        model = CappedTokens(probe, MIB)
        model.max_tokens = 512
        tuner = FakeTuner(probe, budget="24GiB", batch_arg_name="max_tokens")
        logger = CSVLogger(tmp_path, name=name, version=0)
        steps = {"max_steps": 2, "max_epochs": 2} if ckpt_path else {"max_steps": 1}
        trainer = tuner_trainer(tuner, logger=logger, limit_val_batches=0, **steps)
        trainer.fit(model, ckpt_path=ckpt_path)
        if ckpt_path is None:
            trainer.save_checkpoint(tmp_path / "last.ckpt")
        return tuner

    for name, ckpt_path in (("first", None), ("resumed", tmp_path / "last.ckpt")):
        tuner = fit(name, ckpt_path)
        assert tuner.state_dict()["budget_bytes"] == 24 * GIB
        logged = [float(row["gpumem/batch_size_budget_gib"]) for row in read_csv_metrics(tmp_path / name / "version_0")
                  if row.get("gpumem/batch_size_budget_gib")]  # fmt: skip
        assert logged == [24.0], name


@pytest.mark.parametrize(
    ("env", "said", "tip"), [("", "80%", True), ("expandable_segments:True", "94%", False)]
)
def test_the_report_line_says_the_margin_and_suggests_expandable_segments(
    monkeypatch, caplog, env, said, tip
):
    from lightning_gpumem._core.units import GIB, MIB
    from tests.helpers.tuning import CappedFakeProbe, FakeTuner

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = CappedTokens(probe, MIB)
    model.max_tokens = 512
    with caplog.at_level("INFO"):
        tuner_trainer(FakeTuner(probe, budget="24GiB", batch_arg_name="max_tokens"), max_steps=1,
                      limit_val_batches=0).fit(model)  # fmt: skip
    line = next(r.getMessage() for r in caplog.records if "`shape_margin`" in r.getMessage())
    assert f"the trials ran under {said} of the budget" in line
    assert ("expandable_segments:True (set before CUDA starts)" in line) is tip

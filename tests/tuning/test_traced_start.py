"""``BatchSizeTuner(start="trace")``: the step traced before the trials, its size the second trial."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from torch._subclasses.fake_tensor import FakeTensor

from lightning_gpumem import MemoryPlanner
from lightning_gpumem._core.forked import ChildFailed, can_fork
from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw import trace as trace_module
from lightning_gpumem.tuning import traced_start as start_module
from lightning_gpumem.tuning import tune as tune_module
from lightning_gpumem.tuning.search import Guess
from lightning_gpumem.tuning.search.model import Trial
from lightning_gpumem.tuning.sources import traced
from lightning_gpumem.tuning.sources.traced import CannotTrace
from tests.helpers.fakes import kept
from tests.helpers.models import OOMModel
from tests.helpers.trainer import quiet_trainer
from tests.helpers.tuning import CappedFakeProbe, FakeTuner, MemoryModel, tuner_trainer


class Model(MemoryModel):
    """The fake allocator's model; the trace (on fake or meta tensors) sees the BoringModel's step alone."""

    def training_step(self, batch, batch_idx):
        if isinstance(batch, FakeTensor) or batch.device.type == "meta":
            return BoringModel.training_step(self, batch, batch_idx)
        return super().training_step(batch, batch_idx)


def _fit(start: str):
    seed_everything(0)
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = Model(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False, start=start)
    tuner_trainer(tuner, max_steps=2, limit_val_batches=0).fit(model)
    return tuner, model


def test_the_traced_size_is_the_second_trial_and_the_tuned_fit_is_the_probes(monkeypatch):
    guesses: list[tuple[int, int | None]] = []
    real_guess = traced.traced_guess

    def spy(source, limit, **kwargs):
        guess = real_guess(source, limit, **kwargs)
        assert limit == 24 * GIB

        def recorded(trial):
            assert sorted(source.traced) == [2, 5]  # the first trial's size and one more, traced
            found = guess(trial)
            guesses.append((trial.batch_size, found))
            return found

        return recorded

    monkeypatch.setattr(start_module, "traced_guess", spy)
    traced_tuner, traced_model = _fit("trace")
    probe_tuner, probe_model = _fit("probe")
    assert guesses
    assert guesses[0][0] == traced_tuner.trials[0].batch_size == 2
    # the fake GPU is not the traced BoringModel: its guess is far off, and the search closes in all the same
    assert traced_tuner.trials[1].batch_size == min(guesses[0][1].size, 100_000)
    assert traced_tuner.optimal_batch_size == probe_tuner.optimal_batch_size == kept(75, 0.1)
    for a, b in zip(traced_model.parameters(), probe_model.parameters(), strict=True):
        assert torch.equal(a, b)  # the trace touched neither the module nor its optimizer


def test_a_traced_size_less_the_headroom_that_runs_is_kept_after_two_trials(monkeypatch):
    def exact(source, limit, *, headroom, **kwargs):  # the trace as exact as can be: the fake GPU's largest
        assert headroom == 0.1
        return lambda trial: Guess(kept(75, headroom), kept=True)

    monkeypatch.setattr(start_module, "traced_guess", exact)
    traced_tuner, traced_model = _fit("trace")
    probe_tuner, probe_model = _fit("probe")
    assert [t.batch_size for t in traced_tuner.trials] == [2, kept(75, 0.1)]
    assert traced_tuner.optimal_batch_size == probe_tuner.optimal_batch_size == kept(75, 0.1)
    assert len(probe_tuner.trials) > 2
    for a, b in zip(traced_model.parameters(), probe_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_step_that_cannot_be_traced_warns_once_and_the_search_runs_from_its_probe():
    class Manual(Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)["loss"]
            self.manual_backward(loss)
            self.optimizers().step()

    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = Manual(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False, start="trace")
    with pytest.warns(
        UserWarning, match=r"start='trace'.*could not be traced.*manual optimisation"
    ) as caught:
        tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert sum("start='trace'" in str(w.message) for w in caught) == 1
    assert tuner.optimal_batch_size == kept(75, 0.1)


def test_batches_whose_shapes_vary_are_not_traced():
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(
        probe, budget="24GiB", headroom=0.1, include_validation=False, start="trace", length_fn=len
    )
    with pytest.warns(UserWarning, match=r"start='trace'.*shapes vary; the search starts from its probe"):
        tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size is not None


@pytest.mark.parametrize("start", ["guess", None, 1])
def test_start_is_checked(start):
    with pytest.raises(ValueError, match=r"BatchSizeTuner\(start=.*Expected one of \('probe', 'trace'\)"):
        FakeTuner(CappedFakeProbe(), start=start)


def test_the_planners_trace_on_a_cpu_leaves_the_runs_random_streams_as_they_were():
    def fit(callbacks):
        seed_everything(0)
        model = OOMModel(batch_size=4, n=64)  # a shuffled training loader
        quiet_trainer(max_epochs=1, callbacks=callbacks, limit_val_batches=0).fit(model)
        return model

    planned = fit([MemoryPlanner(budgets=["24GiB"])])
    plain = fit([])
    for a, b in zip(planned.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_guess_that_fails_in_the_search_warns_and_the_search_goes_on(monkeypatch):
    def failing(source, limit, **kwargs):
        def guess(trial):
            raise RuntimeError("boom")

        return guess

    monkeypatch.setattr(start_module, "traced_guess", failing)
    with pytest.warns(UserWarning, match=r"start='trace'.*traced guess failed \(RuntimeError: boom\)"):
        tuner, _ = _fit("trace")
    assert tuner.optimal_batch_size == kept(75, 0.1)


def _spied_children(monkeypatch):
    """The traces the forked children sent back, by size."""
    sent: dict[int, object] = {}
    real = start_module.Forked

    class Spy(real):
        def __init__(self, work):
            super().__init__(work)
            self.size = work.args[0].args[0]  # without_cuda(trace_at(size))

        def result(self, timeout):
            sent[self.size] = value = super().result(timeout)
            return value

    monkeypatch.setattr(start_module, "Forked", Spy)
    return sent


@pytest.mark.skipif(not can_fork(), reason="forks on Linux only")
def test_the_two_sizes_are_traced_in_forked_children_as_they_would_be_here(monkeypatch):
    sent = _spied_children(monkeypatch)
    guesses: dict[str, list[object]] = {"forked": [], "here": []}
    real_guess = traced.traced_guess

    def spy(source, limit, **kwargs):
        guess = real_guess(source, limit, **kwargs)

        def recorded(trial):
            found = guess(trial)
            guesses[where].append((trial.batch_size, found, dict(source.traced)))
            return found

        return recorded

    monkeypatch.setattr(start_module, "traced_guess", spy)
    where = "forked"
    forked_tuner, forked_model = _fit("trace")
    assert sorted(sent) == [2, 5]
    assert all(trace.cannot_trace is None and trace.events for trace in sent.values())
    monkeypatch.setattr(start_module, "backward_forks", lambda: False)  # traced here, before the trials
    where = "here"
    here_tuner, here_model = _fit("trace")
    assert guesses["forked"] == guesses["here"]  # the same streams, the same guess
    sizes = [(t.batch_size, t.fits, t.peak_bytes) for t in forked_tuner.trials]
    assert sizes == [(t.batch_size, t.fits, t.peak_bytes) for t in here_tuner.trials]
    for a, b in zip(forked_model.parameters(), here_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not can_fork(), reason="forks on Linux only")
def test_a_forked_trace_that_fails_warns_once_and_the_search_runs_from_its_probe(monkeypatch):
    class Failing(start_module.Forked):
        def result(self, timeout):
            self.close()
            raise ChildFailed("RuntimeError: Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(start_module, "Forked", Failing)
    with pytest.warns(
        UserWarning,
        match=r"start='trace'\): the step could not be traced in a forked process \(RuntimeError: Cannot",
    ) as caught:
        tuner, _ = _fit("trace")
    assert sum("start='trace'" in str(w.message) for w in caught) == 1
    assert tuner.optimal_batch_size == kept(75, 0.1)


def test_without_fork_the_step_is_traced_here_before_the_first_trial(monkeypatch):
    monkeypatch.setattr(start_module, "backward_forks", lambda: False)
    order: list[str] = []
    real_bench = tune_module.TrialBench.run

    def run(self, size):
        order.append(f"trial {size}")
        return real_bench(self, size)

    real_add = traced.TracedSource.add

    def add(self, size, trace):
        order.append(f"traced {size}")
        return real_add(self, size, trace)

    monkeypatch.setattr(tune_module.TrialBench, "run", run)
    monkeypatch.setattr(traced.TracedSource, "add", add)
    tuner, _ = _fit("trace")
    assert order[:3] == ["traced 2", "traced 5", "trial 2"]
    assert tuner.optimal_batch_size == kept(75, 0.1)


def test_the_tuner_traces_on_meta_tensors_first(monkeypatch):
    monkeypatch.setattr(start_module, "backward_forks", lambda: False)  # traced here, where a spy sees it
    stand_ins: list[str] = []
    real_copies = trace_module._trace_copies

    def spy(*args, stand_in, **kwargs):
        stand_ins.append(stand_in)
        return real_copies(*args, stand_in=stand_in, **kwargs)

    monkeypatch.setattr(trace_module, "_trace_copies", spy)
    tuner, _ = _fit("trace")
    assert stand_ins == ["meta", "meta"]  # the two sizes, no fake tensors needed
    assert tuner.optimal_batch_size == kept(75, 0.1)


def test_a_fork_that_cannot_start_is_traced_here_before_the_trials(monkeypatch):
    started: list[int] = []

    class NoRoom(start_module.Forked):
        def __init__(self, work):
            if started:  # the second size's copy: no memory left to fork
                raise OSError(12, "Cannot allocate memory")
            super().__init__(work)
            started.append(self._pid)

    monkeypatch.setattr(start_module, "Forked", NoRoom)
    monkeypatch.setattr(start_module, "backward_forks", lambda: True)
    order: list[str] = []
    real_add = traced.TracedSource.add

    def add(self, size, trace):
        order.append(f"traced {size}")
        return real_add(self, size, trace)

    monkeypatch.setattr(traced.TracedSource, "add", add)
    tuner, _ = _fit("trace")
    assert len(started) == 1  # the first child was started, then stopped
    with pytest.raises(ChildProcessError):  # and reaped
        os.waitpid(started[0], os.WNOHANG)
    assert order == ["traced 2", "traced 5"]
    assert tuner.optimal_batch_size == kept(75, 0.1)


def _ranks(monkeypatch, agreed: bool, broadcast):
    """The tuner's strategy as seen by its traced start: the ranks' agreement and rank 0's broadcast."""
    real_init = start_module.TracedStart.__init__

    class Ranks:
        global_rank, world_size = 0, 2

        def reduce_boolean_decision(self, decision, all=True):
            assert all
            return decision and agreed

        def broadcast(self, obj, src=0):
            assert src == 0
            return broadcast(obj)

    def init(self, trainer, *args, **kwargs):
        real_init(self, trainer, *args, **kwargs)
        self._strategy = Ranks()

    monkeypatch.setattr(start_module.TracedStart, "__init__", init)


def test_where_another_rank_has_no_traced_guess_none_is_tried_and_it_warns_once(monkeypatch):
    def no_broadcast(obj):
        raise AssertionError("nothing is broadcast where the ranks do not agree")

    _ranks(monkeypatch, agreed=False, broadcast=no_broadcast)
    with pytest.warns(UserWarning, match=r"start='trace'\): another rank has no traced guess") as caught:
        tuner, _ = _fit("trace")
    assert sum("start='trace'" in str(w.message) for w in caught) == 1
    probe_tuner, _ = _fit("probe")
    assert [t.batch_size for t in tuner.trials] == [t.batch_size for t in probe_tuner.trials]
    assert tuner.optimal_batch_size == kept(75, 0.1)


def test_every_rank_tries_rank_zeros_guess(monkeypatch):
    _ranks(monkeypatch, agreed=True, broadcast=lambda obj: (Guess(kept(75, 0.1), kept=True), False))
    tuner, _ = _fit("trace")
    assert [t.batch_size for t in tuner.trials] == [2, kept(75, 0.1)]


def test_under_ddp_the_guess_and_its_check_cross_the_ranks_as_plain_objects(monkeypatch):
    sent: list[object] = []

    def pickled(obj):  # as torch.distributed's broadcast_object_list sends it
        sent.append(obj)
        return pickle.loads(pickle.dumps(obj))

    alone, _ = _fit("trace")  # one process
    _ranks(monkeypatch, agreed=True, broadcast=pickled)  # rank 0 of two, its objects sent to itself
    tuner, _ = _fit("trace")
    assert [t.batch_size for t in tuner.trials] == [t.batch_size for t in alone.trials]
    assert tuner.optimal_batch_size == alone.optimal_batch_size
    assert len(sent) == 2  # the guess, then what its check left of it (checked beside its trial)
    assert [type(obj).__name__ for obj in sent] == ["tuple", "Guess"]


def test_another_rank_takes_rank_zeros_guess_and_rank_zeros_check_of_it(monkeypatch):
    zeros = iter([(Guess(kept(75, 0.1), kept=True), True), Guess(kept(75, 0.1) - 1, kept=True)])
    sent: list[object] = []

    def from_rank_zero(obj):
        sent.append(obj)
        return next(zeros)

    _ranks(monkeypatch, agreed=True, broadcast=from_rank_zero)
    real = start_module.TracedStart._agreed

    def as_rank_one(self, guess):
        self._strategy.global_rank = 1
        return real(self, guess)

    monkeypatch.setattr(start_module.TracedStart, "_agreed", as_rank_one)
    tuner, _ = _fit("trace")
    # rank 0's check took its guess back: this rank does as rank 0 does, its own check unasked
    assert [t.batch_size for t in tuner.trials] == [2, kept(75, 0.1), kept(75, 0.1) - 1]
    assert sent[1] is None


def test_a_check_that_fails_after_the_guesss_trial_warns_once_and_the_search_goes_on(monkeypatch):
    def failing(self, run, sizes, replay_seconds):
        def wait():
            raise CannotTrace("cannot trace: some_op")

        return wait

    monkeypatch.setattr(start_module.TracedStart, "_later", failing)
    monkeypatch.setattr(start_module, "backward_forks", lambda: True)
    with pytest.warns(UserWarning, match=r"the check below the traced guess failed") as caught:
        tuner, _ = _fit("trace")
    assert sum("start='trace'" in str(w.message) for w in caught) == 1
    assert tuner.optimal_batch_size is not None
    guessed = tuner.trials[1].batch_size
    assert tuner.optimal_batch_size < guessed  # its guess taken back: never kept on an unchecked trace


def test_a_rank_other_than_zero_starts_no_check_of_its_own(monkeypatch):
    zeros = iter([(Guess(kept(75, 0.1), kept=True), True), Guess(kept(75, 0.1), kept=True)])
    _ranks(monkeypatch, agreed=True, broadcast=lambda obj: next(zeros))
    ranked = start_module.TracedStart.__init__

    def as_rank_one(self, trainer, *args, **kwargs):
        monkeypatch.setattr(trainer.strategy, "global_rank", 1)
        ranked(self, trainer, *args, **kwargs)

    monkeypatch.setattr(start_module.TracedStart, "__init__", as_rank_one)
    started: list[int] = []
    monkeypatch.setattr(start_module, "ForkedMap", lambda *a, **k: started.append(1))
    tuner, _ = _fit("trace")
    assert [t.batch_size for t in tuner.trials] == [2, kept(75, 0.1)]
    assert started == []  # rank 0's check decided; this rank forked none


@pytest.mark.skipif(not can_fork(), reason="forks on Linux only")
def test_the_checks_replays_run_in_as_many_forked_children_as_end_with_the_trial(monkeypatch):
    monkeypatch.setattr(start_module, "cores", lambda: 16)
    asked: list[int] = []
    real_map = start_module.ForkedMap

    def spy(run, sizes, *, workers):
        asked.append(workers)
        return real_map(run, sizes, workers=workers)

    monkeypatch.setattr(start_module, "ForkedMap", spy)

    def run(size):
        return Trial(size, fits=True)

    start = start_module.TracedStart.__new__(start_module.TracedStart)
    start._maps, start._children = [], {}
    start._fork_seconds, start._trial_seconds = 0.05, 0.5
    sizes = list(range(15, 0, -1))
    assert [t.batch_size for t in start._later(run, sizes, 0.02)()] == sizes  # 0.35 s: one child
    assert [t.batch_size for t in start._later(run, sizes, 0.1)()] == sizes  # 1.5 s: four children
    assert asked == [1, 4]
    waiting = start._later(run, sizes, 0.02)
    start.close()  # the search ended before the check was waited for: its children stopped
    assert start._maps == []
    assert [t.batch_size for t in waiting()] == sizes  # made here, once the children are gone
    monkeypatch.setattr(start_module, "cores", lambda: 1)
    assert [t.batch_size for t in start._later(run, sizes, 0.02)()] == sizes
    assert asked == [1, 4, 1]  # one core: nothing forked

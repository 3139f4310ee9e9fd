"""`_pl/patching.py`: an attribute replaced for a while is put back exactly, and nothing else is written."""

from __future__ import annotations

import inspect

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpumem import AutoMicrobatch
from lightning_gpumem._pl.patching import Patches, log_arguments, patched, with_log_argument
from tests.helpers.trainer import quiet_trainer


class Owner:
    def method(self, x: int) -> int:
        return x


def test_patched_replaces_for_the_block_and_leaves_no_instance_attribute():
    owner = Owner()
    before = dict(vars(owner))
    with patched(owner, "method", lambda x: x + 1) as original:
        assert owner.method(1) == 2
        assert original(1) == 1
        assert set(vars(owner)) == {*before, "method"}
    assert vars(owner) == before  # the class's method shows through again
    assert owner.method(1) == 1


def test_patched_puts_back_an_instance_attribute_that_was_there_and_restores_on_error():
    owner = Owner()
    own = owner.method = lambda x: -x  # type: ignore[method-assign]
    with pytest.raises(KeyError), patched(owner, "method", lambda x: 0):
        raise KeyError("the user's error")
    assert owner.method is own


def test_a_wrapper_keeps_the_original_signature_when_asked():
    owner = Owner()
    with patched(owner, "method", lambda *a, **k: None, keep_signature=True):
        assert list(inspect.signature(owner.method).parameters) == ["x"]


def test_patching_over_a_leftover_patch_wraps_the_original_not_the_leftover():
    owner = Owner()
    calls = []
    leftover = Patches()
    leftover.install(
        owner, "method", lambda x: calls.append("leftover")
    )  # never undone: a crash before clean-up
    patches = Patches()
    patches.install(owner, "method", lambda x: calls.append("new") or patches.original(owner, "method")(x))
    assert owner.method(3) == 3
    assert calls == ["new"]  # the leftover is replaced, not called: no loop of wrappers
    patches.undo()
    assert "method" not in vars(owner)
    assert owner.method(4) == 4


def test_patches_undo_in_reverse_order_and_a_second_install_is_ignored():
    owner = Owner()
    patches = Patches()
    patches.install(owner, "method", lambda x: 1)
    patches.install(owner, "method", lambda x: 2)
    assert owner.method(0) == 1
    assert bool(patches)
    patches.undo()
    assert not patches
    assert vars(owner) == {}


def test_log_arguments_are_bound_by_the_signature_of_log():
    module = BoringModel()
    assert log_arguments(module.log, ("loss", 1.0), {"on_step": True}) == {
        "name": "loss",
        "value": 1.0,
        "on_step": True,
    }
    params = list(inspect.signature(module.log).parameters)
    position = params.index("sync_dist")
    args = (
        "loss",
        1.0,
        *[inspect.signature(module.log).parameters[p].default for p in params[2:position]],
        True,
    )
    assert log_arguments(module.log, args, {})["sync_dist"] is True
    _, kwargs = with_log_argument(module.log, args, {}, "sync_dist", False)
    assert kwargs["sync_dist"] is False
    assert with_log_argument(module.log, (), {"bogus": 1}, "sync_dist", False) == (
        (),
        {"bogus": 1, "sync_dist": False},
    )


def _fit_attributes(tmp_path, callbacks):
    model = BoringModel()
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=callbacks, default_root_dir=tmp_path)
    trainer.fit(model)
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    return set(vars(model)), set(vars(loop)), set(vars(trainer))


def test_a_fit_with_auto_microbatch_leaves_no_attribute_on_the_module_the_loop_or_the_trainer(tmp_path):
    assert _fit_attributes(tmp_path, [AutoMicrobatch()]) == _fit_attributes(tmp_path, [])


def test_a_patch_over_another_owners_live_patch_puts_it_back():
    owner = Owner()
    live = Patches()
    live.install(owner, "method", lambda x: x * 10)  # e.g. AutoMicrobatch's `log`, installed for the fit
    wrapper = vars(owner)["method"]
    trial = Patches(collapse_leftovers=False)  # e.g. the tuner's trials, run from `on_train_epoch_start`
    trial.install(owner, "method", lambda x: trial.original(owner, "method")(x) + 1)
    assert owner.method(2) == 21  # through the live patch
    trial.undo()
    assert vars(owner)["method"] is wrapper  # the live patch is back, not removed
    live.undo()
    assert "method" not in vars(owner)


class OverridesLog(BoringModel):
    def log(self, *args, **kwargs):  # a user's override that passes everything on
        return super().log(*args, **kwargs)


def test_log_arguments_bind_through_lightnings_signature_even_for_an_override():
    module = OverridesLog()
    assert log_arguments(module.log, ("loss", 1.0, True), {})["prog_bar"] is True
    args = ("loss", 1.0, False, True, None, None, "mean", False, True)  # sync_dist=True positionally
    assert with_log_argument(module.log, args, {}, "sync_dist", False)[1]["sync_dist"] is False
    too_many = (
        *args,
        None,
        True,
        None,
        None,
        False,
        "extra",
    )  # does not bind: set in its position all the same
    new_args, _ = with_log_argument(module.log, too_many, {}, "sync_dist", False)
    assert new_args[8] is False
    _, kwargs = with_log_argument(module.log, ("loss", 1.0), {"bogus": 1}, "sync_dist", False)
    assert kwargs == {"bogus": 1, "sync_dist": False}  # log raises on `bogus` itself; sync_dist still off

"""Conformance: a fit tuned by BatchSizeTuner is indistinguishable from the same fit with the size set by hand.

Each row is one Lightning set-up. The tuned fit (which must have needed tuning: the size changed and a trial ran out
of memory) and the fit with the chosen size set by hand start from the same seed; afterwards weights, optimizer and
LR-scheduler states, step and epoch counters, checkpoints kept and every logged metric (but the tuner's own
``gpumem/`` ones) must be equal, bit for bit. Out of memory is simulated on CPU by raising the error torch raises once
a batch is larger than a limit.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._core.units import MIB
from lightning_gpumem.tuning.sources.traced import CONTEXT_BYTES
from tests.helpers.ddp import run_script
from tests.helpers.fakes import kept
from tests.helpers.trainer import quiet_trainer
from tests.helpers.tuning import CPU_SEARCH

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # as tests/monitor/test_lightning_cli.py
pytestmark = [
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
    pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
]

SEED = 7
BIG = 10**9  # "never runs out of memory"
VAL_N = 16
DDP_SCRIPT = Path(__file__).with_name("ddp_conformance_script.py")


def _oom(batch: torch.Tensor, limit: int, where: str) -> None:
    if batch.shape[0] > limit:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated, {where})")


def _fake_length(sample: torch.Tensor) -> int:
    """A length for `RandomDataset`'s samples (all 32 wide): the trials then draw them in another order."""
    return int(sample[0].abs() * 1000)


# ---------------------------------------------------------------------------------------------------- models, data
class Net(LightningModule):
    """Two layers; runs out of memory above `train_limit` (training step), `val_limit` (validation step) and
    `opt_limit` (just before the optimizer step, where the optimizer state is created). `batch_size=None`: the batch
    size lives elsewhere (a datamodule, hparams)."""

    def __init__(
        self,
        batch_size: int | None = 2,
        train_limit: int = BIG,
        val_limit: int = BIG,
        opt_limit: int = BIG,
        optimizer: str = "adam",
        scheduler: str = "step",
        n: int = 64,
    ) -> None:
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size
        self.train_limit, self.val_limit, self.opt_limit = train_limit, val_limit, opt_limit
        self.optimizer, self.scheduler = optimizer, scheduler
        self.a = torch.nn.Linear(32, 8)
        self.b = torch.nn.Linear(8, 2)
        self.train_data, self.val_data = (
            RandomDataset(32, n),
            RandomDataset(32, VAL_N),
        )  # drawn once, not per reload
        self.last_size = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        out = self(batch)
        return torch.nn.functional.mse_loss(out, torch.ones_like(out))

    def training_step(self, batch, batch_idx):
        self.last_size = batch.shape[0]
        _oom(batch, self.train_limit, "training_step")
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        _oom(batch, self.val_limit, "validation_step")
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def on_before_optimizer_step(self, optimizer):
        if self.last_size > self.opt_limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated, optimizer state)")

    def _optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def configure_optimizers(self):
        optimizer = self._optimizer(self.parameters())
        if self.scheduler == "step":
            config = {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8),
                "interval": "step",
            }
        elif self.scheduler == "epoch":
            config = {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
                "interval": "epoch",
            }
        else:  # "onecycle": its length depends on the batch size through the number of batches
            total = int(self.trainer.estimated_stepping_batches)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
            config = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": config}

    def loader_batch_size(self) -> int:
        return self.batch_size

    def train_dataloader(self):
        return DataLoader(self.train_data, batch_size=self.loader_batch_size(), shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_data, batch_size=self.loader_batch_size())


class HParamsNet(Net):
    """The batch size in `model.hparams` (`save_hyperparameters`), not an attribute."""

    def __init__(self, batch_size: int = 2, **kwargs: Any) -> None:
        super().__init__(batch_size=None, **kwargs)
        self.save_hyperparameters("batch_size")

    def loader_batch_size(self) -> int:
        return self.hparams.batch_size


class NoValLoaderNet(Net):
    """A `validation_step` and no `val_dataloader` (Lightning skips validation)."""

    val_dataloader = LightningModule.val_dataloader  # not overridden, as if never defined


class ManualNet(Net):
    """Manual optimisation, two optimizers (Adam on `a`, SGD with momentum on `b`) and their StepLRs, stepped by hand.

    The OOM comes after the first optimizer stepped and before the second did: with `toggle`, inside
    `toggle_optimizer(opt_b)` (so `a` is frozen when it is raised); without, between the two steps.
    """

    def __init__(self, toggle: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.toggle = toggle
        self.automatic_optimization = False

    def configure_optimizers(self):
        optimizers = [torch.optim.Adam(self.a.parameters(), lr=0.01), self._optimizer_b()]
        return optimizers, [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.8) for o in optimizers]

    def _optimizer_b(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.b.parameters(), lr=0.05, momentum=0.9)

    def training_step(self, batch, batch_idx):
        self.last_size = batch.shape[0]
        loss = None
        for index, optimizer in enumerate(self.optimizers()):
            if self.toggle:
                self.toggle_optimizer(optimizer)
            if index == 1:
                _oom(batch, self.train_limit, "between the optimizers")
            loss = self.loss(batch)
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if self.toggle:
                self.untoggle_optimizer(optimizer)
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", loss, sync_dist=True)


class Data(LightningDataModule):
    """The batch size in the datamodule: an attribute, or its hparams."""

    def __init__(self, batch_size: int = 2, in_hparams: bool = False, n: int = 64) -> None:
        super().__init__()
        self.in_hparams = in_hparams
        if in_hparams:
            self.save_hyperparameters("batch_size")
        else:
            self.batch_size = batch_size
        self.train_data, self.val_data = RandomDataset(32, n), RandomDataset(32, VAL_N)

    def _size(self) -> int:
        return self.hparams.batch_size if self.in_hparams else self.batch_size

    def train_dataloader(self):
        return DataLoader(self.train_data, batch_size=self._size(), shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_data, batch_size=self._size())


# ---------------------------------------------------------------------------------------------- capture and compare
def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clone(v) for v in obj]
    return obj


def _csv_metrics(log_root: Path) -> dict[str, list[dict[str, str]]]:
    """Rows of every metrics.csv under `log_root`, without `gpumem/` columns and the rows only they filled."""
    out = {}
    for path in sorted(log_root.rglob("metrics.csv")):
        with path.open(newline="") as f:
            rows = [
                {k: v for k, v in row.items() if not k.startswith("gpumem/")} for row in csv.DictReader(f)
            ]
        out[str(path.relative_to(log_root))] = [
            r for r in rows if any(v for k, v in r.items() if k != "step")
        ]
    return out


def capture(trainer: Trainer, root: Path) -> dict[str, Any]:
    """Everything a fit leaves that the comparison looks at (files: on global rank zero only, their writer)."""
    module = trainer.lightning_module
    result: dict[str, Any] = {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "weights": _clone(module.state_dict()),
        "requires_grad": {name: p.requires_grad for name, p in module.named_parameters()},
        "optimizers": [_clone(o.state_dict()) for o in trainer.optimizers],
        "lr_schedulers": [_clone(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
        "callback_metrics": {
            k: _clone(v) for k, v in trainer.callback_metrics.items() if not k.startswith("gpumem/")
        },
    }
    if trainer.is_global_zero:
        result["metrics.csv"] = _csv_metrics(root / "logs")
        result["checkpoints"] = [
            {
                "files": sorted(os.listdir(cb.dirpath)) if cb.dirpath and os.path.isdir(cb.dirpath) else [],
                "best_model_score": _clone(cb.best_model_score),
                "best_model_path": os.path.basename(cb.best_model_path),
            }
            for cb in trainer.checkpoint_callbacks
        ]
    return result


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.tolist()) if value.numel() <= 4 else f"tensor{tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def differences(tuned: Any, by_hand: Any, path: str = "") -> list[str]:
    """Where `tuned` and `by_hand` differ (tensors: same dtype, shape and bits), as `path: tuned != by_hand` lines."""
    if isinstance(tuned, torch.Tensor) or isinstance(by_hand, torch.Tensor):
        same = (
            isinstance(tuned, torch.Tensor)
            and isinstance(by_hand, torch.Tensor)
            and tuned.dtype == by_hand.dtype
            and tuned.shape == by_hand.shape
            and torch.equal(tuned, by_hand)
        )
        if same:
            return []
        if (
            isinstance(tuned, torch.Tensor)
            and isinstance(by_hand, torch.Tensor)
            and tuned.shape == by_hand.shape
        ):
            diff = (tuned.double() - by_hand.double()).abs().max().item() if tuned.numel() else 0.0
            return [f"{path}: {_short(tuned)} != {_short(by_hand)} (max |difference| {diff:.3g})"]
        return [f"{path}: {_short(tuned)} != {_short(by_hand)}"]
    if isinstance(tuned, Mapping) and isinstance(by_hand, Mapping):
        problems = []
        if tuned.keys() != by_hand.keys():
            only_tuned, only_hand = tuned.keys() - by_hand.keys(), by_hand.keys() - tuned.keys()
            problems.append(
                f"{path}: keys only tuned {sorted(map(str, only_tuned))}, only by hand {sorted(map(str, only_hand))}"
            )
        for key in tuned:
            if key in by_hand:
                problems += differences(tuned[key], by_hand[key], f"{path}.{key}" if path else str(key))
        return problems
    if isinstance(tuned, (list, tuple)) and isinstance(by_hand, (list, tuple)):
        problems = [] if len(tuned) == len(by_hand) else [f"{path}: length {len(tuned)} != {len(by_hand)}"]
        for index, (a, b) in enumerate(zip(tuned, by_hand)):
            problems += differences(a, b, f"{path}[{index}]")
        return problems
    return [] if tuned == by_hand else [f"{path}: {_short(tuned)} != {_short(by_hand)}"]


def assert_indistinguishable(tuned: dict[str, Any], by_hand: dict[str, Any], label: str = "") -> None:
    problems = differences(tuned, by_hand)
    shown = "\n  ".join(problems[:15] + ([f"... {len(problems) - 15} more"] if len(problems) > 15 else []))
    assert not problems, (
        f"{label}tuned fit != fit with the size set by hand ({len(problems)} differences):\n  {shown}"
    )


# ------------------------------------------------------------------------------------------------------------ rows
def _no_callbacks(root: Path) -> list[Callback]:
    return []


@dataclass(frozen=True)
class Row:
    """One Lightning set-up: builds the model, datamodule, Trainer arguments and callbacks for a batch size."""

    model: Callable[..., Net] = Net
    model_kwargs: Mapping[str, Any] = field(default_factory=lambda: {"train_limit": 12})
    datamodule: Mapping[str, Any] | None = None  # Data kwargs: the batch size lives in a datamodule
    trainer: Mapping[str, Any] = field(default_factory=dict)
    callbacks: Callable[[Path], list[Callback]] = _no_callbacks
    tuner: Mapping[str, Any] = field(default_factory=dict)
    init: int = 2  # the batch size the tuned run starts from
    resume: Mapping[str, Any] | None = (
        None  # Trainer overrides of a second fit resumed from the first's checkpoint
    )
    premise: Callable[[dict[str, Any]], bool] = lambda out: (
        True
    )  # the fit by hand does what the row is named for

    def build(self, batch_size: int) -> tuple[Net, LightningDataModule | None]:
        if self.datamodule is None:
            return self.model(batch_size=batch_size, **self.model_kwargs), None
        return self.model(batch_size=None, **self.model_kwargs), Data(
            batch_size=batch_size, **self.datamodule
        )

    def make(
        self, root: Path, phase: int, batch_size: int, tune: bool, overrides: Mapping[str, Any]
    ) -> tuple[Trainer, Net, LightningDataModule | None, BatchSizeTuner | None]:
        model, datamodule = self.build(batch_size)
        tuner = BatchSizeTuner(**{"max_val": CPU_SEARCH, **self.tuner}) if tune else None
        callbacks = [*([tuner] if tuner else []), *self.callbacks(root)]
        if not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
            callbacks.append(ModelCheckpoint(dirpath=root / "ckpt"))
        kwargs = {
            "devices": 1,
            "max_epochs": 1,
            "log_every_n_steps": 1,
            "logger": CSVLogger(root / "logs", name=f"fit{phase}", version=0),
            "callbacks": callbacks,
            "enable_checkpointing": True,
            **overrides,
        }
        return quiet_trainer(root, **kwargs), model, datamodule, tuner

    def fit(
        self, root: Path, batch_size: int, tune: bool, accumulate: int | None = None
    ) -> tuple[Trainer, list[BatchSizeTuner | None]]:
        phases = [dict(self.trainer)]
        if self.resume is not None:
            phases.append({**self.trainer, **self.resume})
        tuners, ckpt_path, trainer = [], None, None
        for phase, overrides in enumerate(phases, 1):
            if accumulate is not None:
                overrides["accumulate_grad_batches"] = accumulate
            trainer, model, datamodule, tuner = self.make(root, phase, batch_size, tune, overrides)
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
            tuners.append(tuner)
            if phase < len(phases):
                ckpt_path = root / f"fit{phase}.ckpt"
                trainer.save_checkpoint(ckpt_path)
        return trainer, tuners

    def run(self, root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The tuned fit and the fit with the size set by hand: one capture each (per rank)."""
        seed_everything(SEED)
        trainer, tuners = self.fit(root / "tuned", self.init, tune=True)
        first = tuners[0]
        chosen = first.optimal_batch_size
        assert chosen is not None
        assert chosen != self.init, f"the row needs no tuning: {self.init} was chosen"
        self.check_search(first)
        for later in tuners[1:]:  # resumed fits: the size comes back, re-tuned or from the tuner's state
            assert later.optimal_batch_size == chosen
            retunes = self.tuner.get("retune_on_resume", False)
            ran = [(t.batch_size, t.fits) for t in later.trials]
            assert bool(ran) == retunes, (
                f"resumed with retune_on_resume={retunes}, trials (size, fits): {ran}"
            )
        tuned = capture(trainer, root / "tuned")

        seed_everything(SEED)
        trainer, _ = self.fit(
            root / "by_hand", chosen, tune=False, accumulate=trainer.accumulate_grad_batches
        )
        by_hand = capture(trainer, root / "by_hand")
        assert self.premise(by_hand), "the fit by hand does not exercise what the row is named for"
        return [tuned], [by_hand]

    def check_search(self, tuner: BatchSizeTuner) -> None:
        """What the tuned fit's search must have done: here, a trial ran out of memory."""
        assert any(not t.fits for t in tuner.trials), "no trial ran out of memory: the row tests no OOM"


class WideNet(Net):
    """`Net` with a wide temporary (2 MiB a sample) that the trace counts: memory bounds the traced size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x))
        wide = hidden.repeat(1, 65536)
        return self.b(hidden) + 0.0 * wide.mean()


# a CPU Trainer, a budget in bytes: the size traced (about 16 of WideNet), no trial
TRACED = {"budget": CONTEXT_BYTES + 110 * MIB, "max_val": None}


@dataclass(frozen=True)
class TracedRow(Row):
    """A CPU Trainer with a budget in bytes: the tuner traces the step on fake tensors and runs no trial.

    The trace copies the module and optimizer and draws the first batches; the fit must not see it.
    """

    model: Callable[..., Net] = WideNet
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)  # no simulated OOM: nothing runs for real
    tuner: Mapping[str, Any] = field(default_factory=lambda: TRACED)

    def check_search(self, tuner: BatchSizeTuner) -> None:
        assert not tuner.trials, "a traced size runs no trial"


@dataclass(frozen=True)
class CliRow(Row):
    """The model and Trainer from `LightningCLI(run=False)`, the tuner added on the command line."""

    def make(self, root, phase, batch_size, tune, overrides):
        from lightning.pytorch.cli import LightningCLI

        args = [
            "--seed_everything=false",  # seeded by the test, as every row
            f"--model.batch_size={batch_size}",
            *(f"--model.{k}={v}" for k, v in self.model_kwargs.items()),
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_epochs=1",
            "--trainer.log_every_n_steps=1",
            f"--trainer.default_root_dir={root}",
            "--trainer.logger=CSVLogger",
            f"--trainer.logger.save_dir={root / 'logs'}",
            f"--trainer.logger.name=fit{phase}",
            "--trainer.logger.version=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            *(f"--trainer.{k}={v}" for k, v in overrides.items()),
        ]
        if tune:
            args.append("--trainer.callbacks+=lightning_gpumem.BatchSizeTuner")
            args.append(f"--trainer.callbacks.max_val={CPU_SEARCH}")
        cli = LightningCLI(self.model, run=False, args=args, save_config_callback=None)
        tuners = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchSizeTuner)]
        assert len(tuners) == int(tune)
        return cli.trainer, cli.model, None, tuners[0] if tuners else None


@dataclass(frozen=True)
class DdpRow(Row):
    """2 CPU ranks (gloo), OOM above 24 on rank 1 and above 40 on rank 0; tuned and by hand in one process pair."""

    def run(self, root):
        root, _ = run_script(DDP_SCRIPT)  # the rank pair test_ddp_cpu.py's agreement test reads too
        ranks = [torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
        for rank in ranks:
            assert rank["chosen"] == kept(24) != rank["init"], rank[
                "chosen"
            ]  # the smaller rank's limit, on both ranks
            assert rank["ooms"] > 0
        return [r["tuned"] for r in ranks], [r["by_hand"] for r in ranks]


def _checkpoint_top2(root: Path) -> list[Callback]:
    return [
        ModelCheckpoint(
            monitor="val_loss", save_top_k=2, dirpath=root / "ckpt", filename="{epoch}-{step}-{val_loss:.5f}"
        )
    ]


def _validations(out: dict[str, Any]) -> int:
    return sum(bool(row.get("val_loss")) for rows in out["metrics.csv"].values() for row in rows)


def _early_stopping(root: Path) -> list[Callback]:
    # val_loss keeps falling here; `min_delta` makes the stop come (after epoch 4 of 8) instead of never.
    return [EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)]


NO_VALIDATION = {"premise": lambda out: "val_loss" not in out["callback_metrics"]}
TWO_VALIDATIONS = {"premise": lambda out: _validations(out) == 2}  # 6 batches: after the 3rd and the 6th


def _resume(first: int, second: int) -> dict[str, Any]:
    """Fit 1 stops at `first` steps and saves a checkpoint; fit 2 resumes from it up to `second` (6 steps an epoch)."""
    return {
        "trainer": {"max_steps": first, "max_epochs": 5},
        "resume": {"max_steps": second},
        "premise": lambda out: out["global_step"] == second,
    }


ROWS = [
    pytest.param(Row(), id="01-plain-adam-steplr-per-step"),
    pytest.param(
        Row(
            model_kwargs={"train_limit": 20, "opt_limit": 12, "optimizer": "sgd", "n": 96},
            trainer={"accumulate_grad_batches": 4},
        ),
        id="02-accumulate4-oom-at-optimizer-state",
    ),
    pytest.param(
        Row(
            model_kwargs={"train_limit": 8},
            trainer={"accumulate_grad_batches": 4},
            tuner={"keep_effective_batch": True},
            init=4,
        ),
        id="03-keep-effective-batch-accumulate4",
    ),
    pytest.param(Row(model=ManualNet), id="04-manual-two-optimizers-toggled-oom-between"),
    pytest.param(
        Row(model=ManualNet, model_kwargs={"train_limit": 12, "toggle": False}),
        id="05-manual-two-optimizers-two-schedulers",
    ),
    pytest.param(
        Row(
            model_kwargs={"train_limit": 12, "scheduler": "epoch"},
            trainer={"max_epochs": 2},
            premise=lambda out: out["lr_schedulers"][0]["last_epoch"] == 2,
        ),
        id="06-epoch-interval-scheduler-2-epochs",
    ),
    pytest.param(
        Row(model_kwargs={"train_limit": 12, "optimizer": "sgd", "scheduler": "onecycle"}),
        id="07-onecycle-estimated-stepping-batches",
    ),
    pytest.param(
        Row(
            callbacks=_checkpoint_top2,
            trainer={"max_epochs": 3, "num_sanity_val_steps": 0},
            premise=lambda out: len(out["checkpoints"][0]["files"]) == 2,  # of 3
        ),
        id="08-modelcheckpoint-val-loss-top2",
    ),
    pytest.param(
        Row(
            callbacks=_early_stopping,
            trainer={"max_epochs": 8},
            premise=lambda out: out["current_epoch"] < 8,
        ),
        id="09-early-stopping",
    ),
    pytest.param(Row(trainer={"num_sanity_val_steps": 0}), id="10-no-sanity-check"),
    pytest.param(Row(trainer={"limit_val_batches": 0}, **NO_VALIDATION), id="11-limit-val-batches-0"),
    pytest.param(Row(model=NoValLoaderNet, **NO_VALIDATION), id="12-validation-step-without-val-dataloader"),
    pytest.param(Row(trainer={"val_check_interval": 3}, **TWO_VALIDATIONS), id="13-val-check-interval-int"),
    pytest.param(
        Row(trainer={"val_check_interval": 0.5}, **TWO_VALIDATIONS), id="14-val-check-interval-float"
    ),
    pytest.param(Row(datamodule={}), id="15-datamodule-attribute"),
    pytest.param(Row(model=HParamsNet), id="16-model-hparams"),
    pytest.param(Row(datamodule={"in_hparams": True}), id="17-datamodule-hparams"),
    pytest.param(CliRow(), id="18-lightning-cli"),
    pytest.param(Row(model_kwargs={"train_limit": 20, "val_limit": 12}), id="19-validation-oom"),
    pytest.param(Row(**_resume(6, 10)), id="20a-resume-end-of-epoch-size-from-tuner-state"),
    pytest.param(
        Row(**_resume(6, 10), tuner={"retune_on_resume": True}), id="20b-resume-end-of-epoch-retune"
    ),
    pytest.param(Row(**_resume(3, 8)), id="20c-resume-mid-epoch-size-from-tuner-state"),
    pytest.param(Row(**_resume(3, 8), tuner={"retune_on_resume": True}), id="20d-resume-mid-epoch-retune"),
    pytest.param(DdpRow(), id="21-ddp-2-cpu-ranks-oom-on-rank1-only", marks=pytest.mark.ddp),
    pytest.param(Row(tuner={"length_fn": _fake_length}), id="22a-length-fn-longest-samples-first"),
    pytest.param(Row(datamodule={}, tuner={"length_fn": _fake_length}), id="22b-length-fn-datamodule"),
    pytest.param(TracedRow(), id="23a-cpu-traced-budget"),
    pytest.param(TracedRow(trainer={"accumulate_grad_batches": 4}), id="23b-cpu-traced-accumulate4"),
    pytest.param(
        TracedRow(model_kwargs={"optimizer": "sgd", "scheduler": "onecycle"}), id="23c-cpu-traced-onecycle"
    ),
    pytest.param(TracedRow(datamodule={}), id="23d-cpu-traced-datamodule"),
    pytest.param(TracedRow(**_resume(3, 8)), id="23e-cpu-traced-resume-mid-epoch-size-from-tuner-state"),
    pytest.param(
        TracedRow(callbacks=_checkpoint_top2, trainer={"max_epochs": 3, "num_sanity_val_steps": 0}),
        id="23f-cpu-traced-modelcheckpoint-top2",
    ),
]


@pytest.mark.parametrize("row", ROWS)
def test_tuned_fit_is_indistinguishable_from_the_size_set_by_hand(row, tmp_path):
    tuned, by_hand = row.run(tmp_path)
    for rank, (a, b) in enumerate(zip(tuned, by_hand, strict=True)):
        assert_indistinguishable(a, b, label=f"rank {rank}: " if len(tuned) > 1 else "")

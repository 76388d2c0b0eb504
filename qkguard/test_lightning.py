"""qkguard/lightning.py: the guard under a PyTorch Lightning Trainer.

Needs lightning (or pytorch_lightning); skipped without it. qkguard.example's NanoGPT (torch alone) in a
tiny LightningModule, on a fixed copy task at a learning rate where its max logit passes THRESHOLD
within the first updates, so the guard fires before the mid-run checkpoint. The runs use lightning.pytorch
where it is installed, else pytorch_lightning; the other's Trainer, where both are, runs one test.
"""
import csv
import importlib
import importlib.util
import sys

import pytest
import torch

try:
    import lightning.pytorch as pl
except ModuleNotFoundError:
    pl = pytest.importorskip("pytorch_lightning")

import qkguard                                                              # noqa: E402
import qkguard.lightning                                                    # noqa: E402
from qkguard.example import NanoGPT                                         # noqa: E402
from qkguard.lightning import STATE_KEY, QKGuardLightningCallback          # noqa: E402

# Lightning's own notes, not the guard's: its pytree helper on this torch, and the resumed runs' checkpoint
# folder, which is not the one the checkpoint was saved from
pytestmark = [pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
              pytest.mark.filterwarnings("ignore:The dirpath has changed")]

VOCAB, T, BATCH = 32, 16, 4
STEPS, SAVE_AT = 6, 3       # the updates of a run, and the mid-run checkpoint (the end of epoch 0) resumed from
THRESHOLD = 0.08            # NanoGPT's max logit passes it on the second update (about 0.096 there)


def tokens(n):
    """n sequences of the copy task: a random half, repeated (as qkguard.example's copy_batch)."""
    half = torch.randint(0, VOCAB, (n, T // 2 + 1), generator=torch.Generator().manual_seed(1))
    return torch.cat([half, half], dim=1)[:, :T + 1]


def module_class(package):
    class Module(package.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = NanoGPT(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32)
            self.losses = []        # (global_step before the update, loss) per micro-batch

        def training_step(self, batch, batch_idx):
            x, y = batch
            _, loss = self.model(x, y)
            self.losses.append((self.global_step, loss.item()))
            self.log("loss", loss, on_step=True, on_epoch=False, batch_size=len(x))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
    return Module


def fit(tmp, steps=STEPS, accumulate=1, resume=None, every=1, logger=True, callback=QKGuardLightningCallback,
        package=pl):
    """A Lightning run of `steps` updates (from the checkpoint `resume`, if given), checkpointed after update
    SAVE_AT: its module, guard, callback(guard) and trainer. An epoch is SAVE_AT updates (accumulate batches
    each), so the checkpoint is at an epoch's end. The saver is listed first: Lightning runs checkpoint
    callbacks last, so the state saved holds the guard's step of the update the checkpoint is of."""
    torch.manual_seed(0)
    module = module_class(package)()
    guard = qkguard.attach(module.model, threshold=THRESHOLD)
    callback = callback(guard)
    x = tokens(SAVE_AT * accumulate * BATCH)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:]), batch_size=BATCH)
    saver = package.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=SAVE_AT, save_top_k=-1)
    trainer = package.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, log_every_n_steps=every,
                              callbacks=[saver, callback], accelerator="cpu", devices=1, enable_progress_bar=False,
                              enable_model_summary=False, logger=package.loggers.CSVLogger(tmp) if logger else False)
    trainer.fit(module, data, ckpt_path=resume)
    return module, guard, callback, trainer


def saved(tmp):
    (path,) = (tmp / "ckpt").glob(f"*step={SAVE_AT}.ckpt")
    return path


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_guard_steps_once_per_optimizer_update(tmp_path, accumulate):
    """STEPS updates, of `accumulate` micro-batches each: STEPS guard steps, and the event in Lightning's
    numbering (global_step after the update, from 1; the guard counts from 0)."""
    module, guard, callback, trainer = fit(tmp_path, accumulate=accumulate, logger=False)
    assert trainer.global_step == STEPS and len(module.losses) == STEPS * accumulate
    assert guard.steps == STEPS
    (event,), (renumbered,) = guard.events, callback.events
    assert renumbered["step"] == event["step"] + 1 and renumbered["active_from"] == event["active_from"] + 1


def test_signals_reach_callback_metrics_and_the_loggers_in_the_updates_row(tmp_path):
    """Logged every 2 updates: the signals in trainer.callback_metrics, and in the CSV rows of Lightning's
    log steps beside the loss; the event's fields once, in the row of the update the guard acted on."""
    _, guard, callback, trainer = fit(tmp_path, every=2)
    assert {"qkguard/max_logit", "qkguard/sigma_product", "qkguard/on"} <= set(trainer.callback_metrics)
    assert trainer.callback_metrics["qkguard/on"] == 1.0 and guard.triggered
    with open(trainer.logger.experiment.metrics_file_path) as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): r for r in rows if r["loss"] and r["qkguard/max_logit"]}
    assert sorted(logged) == [1, 3, 5]               # global_step 2, 4, 6: Lightning's row of global_step N is N - 1
    (event,) = callback.events
    acted = [r for r in rows if r["qkguard/guard_trigger/step"]]
    assert len(acted) == 1 and int(acted[0]["step"]) == event["active_from"] - 2   # the update before active_from
    assert float(acted[0]["qkguard/guard_trigger/step"]) == event["step"]
    assert float(acted[0]["qkguard/guard_trigger/value"]) == pytest.approx(event["value"])
    assert float(acted[0]["qkguard/on"]) == 1.0       # off Lightning's log steps, the signals beside the event
    assert float(logged[5]["qkguard/on"]) == 1.0 and float(logged[5]["qkguard/sigma_product"]) > 0


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_resumed_lightning_run_is_the_uninterrupted_one_bit_for_bit(tmp_path, accumulate):
    """STEPS updates in one go, against a new Trainer resumed from its checkpoint after update SAVE_AT: the
    same losses and the same guard state bit for bit, the guard having fired before the checkpoint."""
    whole, guard, callback, _ = fit(tmp_path / "whole", accumulate=accumulate, logger=False)
    # the check needs a fire before the save: on from the first update after it at the latest
    assert guard.triggered and callback.events[0]["active_from"] <= SAVE_AT + 1
    path = saved(tmp_path / "whole")
    assert torch.load(path, weights_only=True)[STATE_KEY]["guard"]["trigger"] is not None
    later, resumed, resumed_callback, trainer = fit(tmp_path / "later", accumulate=accumulate, logger=False,
                                                    resume=str(path))
    assert trainer.global_step == resumed.steps == guard.steps == STEPS and resumed.triggered
    assert resumed.events == guard.events and resumed_callback.events == callback.events     # kept across it
    assert later.losses == [(s, loss) for s, loss in whole.losses if s >= SAVE_AT]
    a, b = guard.state_dict(), resumed.state_dict()
    assert a["guard"] == b["guard"] and torch.equal(a["generator"], b["generator"])
    assert a["sample_seed"] == b["sample_seed"] and all(torch.equal(a["sigma_v"][k], b["sigma_v"][k]) for k in a["sigma_v"])
    assert torch.equal(guard.max_logit, resumed.max_logit)


def test_a_checkpoint_without_the_guards_state_is_refused_in_one_line(tmp_path):
    """A checkpoint saved without the callback: refused, since a fired model would resume unguarded;
    missing_ok=True starts the guard anew (dormant, counting from 0) from the checkpoint's weights."""
    fit(tmp_path, steps=SAVE_AT, logger=False)
    path = saved(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint[STATE_KEY]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=rf"^QKGuardLightningCallback: the checkpoint .*step={SAVE_AT}.ckpt has no "
                                         rf"'qkguard' entry .*QKGuardLightningCallback\(guard, missing_ok=True\)"):
        fit(tmp_path / "refused", logger=False, resume=str(path))
    _, guard, _, trainer = fit(tmp_path / "anew", logger=False, resume=str(path),
                               callback=lambda guard: QKGuardLightningCallback(guard, missing_ok=True))
    assert trainer.global_step == STEPS and guard.steps == STEPS - SAVE_AT


def test_a_guard_on_another_model_is_refused(tmp_path):
    other = qkguard.attach(NanoGPT(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="attached to a model that is not in the LightningModule"):
        fit(tmp_path, logger=False, callback=lambda guard: QKGuardLightningCallback(other))


@pytest.mark.parametrize("name", [package.__name__ for package in qkguard.lightning.PACKAGES])
def test_either_lightnings_trainer_takes_the_callback(tmp_path, name):
    """lightning.pytorch's Trainer and pytorch_lightning's, each with its own LightningModule: where both are
    installed, one callback class serves both."""
    module, guard, callback, trainer = fit(tmp_path, steps=2, logger=False, package=importlib.import_module(name))
    assert trainer.global_step == guard.steps == 2 and "qkguard/max_logit" in trainer.callback_metrics


def test_without_lightning_pytorch_lightning_serves_and_without_either_one_line(monkeypatch):
    monkeypatch.setattr(qkguard, "lightning", qkguard.lightning)      # the import below rebinds it
    monkeypatch.delitem(sys.modules, "qkguard.lightning")
    for name in ("lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)                  # as if not installed
    if importlib.util.find_spec("pytorch_lightning") is not None:
        assert [p.__name__ for p in importlib.import_module("qkguard.lightning").PACKAGES] == ["pytorch_lightning"]
        monkeypatch.delitem(sys.modules, "qkguard.lightning")
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(ImportError, match=r"^qkguard.lightning needs PyTorch Lightning: pip install lightning"):
        importlib.import_module("qkguard.lightning")

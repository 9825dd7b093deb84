"""train's checkpoints: an interrupted run resumes where it stopped (one process and DDP on two CPU
processes), the best epoch's weights survive a resume, a finished run is not resumed by another."""

from __future__ import annotations

import json

import pytest
import torch

from specdecpp.stopping.head import AcceptanceHead
from tests.helpers.paths import REPO
from tests.helpers.train import base_overrides, random_rows, save_dataset, train_cfg
from train import run
from train.module import AcceptanceHeadModule


def test_best_weights_are_the_monitored_best_epochs_and_survive_a_resume(tiny_dataset, tiny_pair, tmp_path,
                                                                        monkeypatch):
    """weights=best_val keeps the weights of the epoch whose monitored val/loss is lowest (Lightning's
    ModelCheckpoint(monitor="val/loss")): a run whose val/loss is best at epoch 1 of 3 saves epoch 1's
    head, not epoch 0's or 2's; a run interrupted in epoch 2 and resumed still does."""
    scripted = {0: 0.5, 1: 0.2, 2: 0.9}  # val/loss by epoch: best at epoch 1
    snapshots = {}
    real_end, real_step = AcceptanceHeadModule.on_validation_epoch_end, AcceptanceHeadModule.training_step

    def scripted_end(self):
        self._val_sum = scripted[self.current_epoch] * self._val_count
        real_end(self)
        snapshots[self.current_epoch] = {k: v.clone() for k, v in self.head.state_dict().items()}

    def crashing_step(self, batch, batch_idx):
        if self.global_step == crash_at:
            raise RuntimeError("simulated crash")
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(AcceptanceHeadModule, "on_validation_epoch_end", scripted_end)
    monkeypatch.setattr(AcceptanceHeadModule, "training_step", crashing_step)

    def overrides(out):  # 6 steps per epoch, a checkpoint every 2
        return [*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=cpu", "trainer.max_epochs=3"),
                "+experiment=wrej3_d1", "~callbacks.progress_bar", "callbacks.checkpoint.every_n_train_steps=2",
                "optimizer.lr=0.05", f"out={out}"]

    crash_at = -1
    result = run(train_cfg(overrides(tmp_path / "one")))
    assert result["module"].val_loss_per_epoch == pytest.approx([0.5, 0.2, 0.9])
    saved = AcceptanceHead.from_pretrained(tmp_path / "one")
    torch.testing.assert_close(saved.state_dict(), snapshots[1])
    for other in (0, 2):  # the weights did change between epochs: the choice is visible
        assert not torch.allclose(saved.state_dict()["blocks.0.linear.weight"],
                                  snapshots[other]["blocks.0.linear.weight"]), other
    assert (saved.meta["training"]["weights"], saved.meta["training"]["best_epoch"]) == ("best_val", 1)
    torch.testing.assert_close(result["module"].head.cpu().state_dict(), snapshots[1])  # evaluated with them

    first_run = dict(snapshots)
    snapshots.clear()
    crash_at = 14  # in epoch 2, after the checkpoint at step 14: resumed from there
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(train_cfg(overrides(tmp_path / "two")))
    assert sorted(snapshots) == [0, 1]
    crash_at = -1
    snapshots.clear()
    resumed = AcceptanceHead.from_pretrained(run(train_cfg(overrides(tmp_path / "two")))["out"])
    assert sorted(snapshots) == [2]  # only epoch 2 ran again: epoch 1's best came from the checkpoint
    assert resumed.meta["training"]["best_epoch"] == 1
    torch.testing.assert_close(resumed.state_dict(), first_run[1])


def test_interrupted_run_resumes_from_its_last_checkpoint(tiny_dataset, tiny_pair, tmp_path, monkeypatch):
    """Crash at step 5 with checkpoints every 2 steps; the same command resumes at step 4 mid-epoch
    and trains on exactly the prompts an uninterrupted run would (raw rows show which)."""
    def overrides(out):
        return [*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=cpu", "trainer.max_epochs=2"),
                "+experiment=wrej3_d1", "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.progress_bar",
                "data.cache_features=false", f"out={out}"]

    seen = []
    real_step = AcceptanceHeadModule.training_step

    def recording_step(self, batch, batch_idx):
        if self.global_step == crash_at:
            raise RuntimeError("simulated crash")
        seen.append((self.global_step, tuple(batch["row"])))
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(AcceptanceHeadModule, "training_step", recording_step)
    crash_at = -1
    reference = run(train_cfg(overrides(tmp_path / "reference")))
    uninterrupted, seen = seen, []
    assert [step for step, _ in uninterrupted] == list(range(12))  # 24 prompts / 4 per batch x 2 epochs

    crash_at = 5
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(train_cfg(overrides(tmp_path / "head")))
    last = tmp_path / "head" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    assert not (tmp_path / "head" / "model.safetensors").exists()

    crash_at, before = -1, seen[:4]
    seen = []
    result = run(train_cfg(overrides(tmp_path / "head")))  # the same command again
    assert [step for step, _ in seen] == list(range(4, 12))
    assert before + seen == uninterrupted  # same prompts in the same order: none lost, none repeated
    assert result["global_step"] == 12
    assert AcceptanceHead.from_pretrained(tmp_path / "head").meta["training"]["global_step"] == 12
    torch.testing.assert_close(result["module"].head.state_dict(), reference["module"].head.state_dict())

    with pytest.raises(ValueError, match="checkpoint of a different training run.*loss.w_rej: 3.*12"):
        run(train_cfg([*overrides(tmp_path / "head"), "loss.w_rej=12"]))


def test_ranks_share_every_global_batch_once_even_when_smaller_than_the_world(tiny_pair):
    """N ranks together step through exactly the batches of one process, in the same steps; a
    rank whose share of a small last batch is empty still steps (a zero loss with a graph)."""
    from train.data import EpochShuffle, RankBatches, collate_cached

    one = list(RankBatches(EpochShuffle(11, 3), 5))
    for world in (2, 3, 7):
        ranks = [list(RankBatches(EpochShuffle(11, 3), 5, rank, world)) for rank in range(world)]
        assert all(len(r) == len(one) == 3 for r in ranks)
        assert [sum((r[step] for r in ranks), []) for step in range(3)] == one
    assert [len(r[2]) for r in [list(RankBatches(EpochShuffle(11, 3), 5, k, 3)) for k in range(3)]] == [0, 0, 1]
    module = AcceptanceHeadModule(AcceptanceHead(32, 1), optimizer=torch.optim.Adam, w_rej=3.0)
    loss, logits, labels = module.model_step(collate_cached([]))
    assert float(loss.detach()) == 0.0 and loss.requires_grad and logits.shape == labels.shape == (0,)


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_the_one_process_head_and_resumes(tiny_dataset, tiny_pair, tmp_path):
    """trainer=ddp with 2 CPU processes (gloo): the run crashes at step 5 (checkpoint at step 4),
    the same command resumes it; the saved head and its metrics equal those of one process
    (global batch 5: rank shares of 2 and 3 prompts; 2 and 2 for the last one)."""
    import os
    import subprocess
    import sys

    def overrides(out, *extra):
        return [*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=cpu", "trainer.max_epochs=2"),
                "+experiment=wrej3_d1", "data.batch_size=5", "callbacks.checkpoint.every_n_train_steps=2",
                "~callbacks.progress_bar", "~callbacks.lr_monitor", "trainer.enable_model_summary=false",
                f"out={out}", *extra]

    reference = run(train_cfg(overrides(tmp_path / "one")))
    command = [sys.executable, "-m", "train", *overrides(
        tmp_path / "ddp", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
        "+callbacks.crash._target_=tests.helpers.crash_callback.CrashOnce", "+callbacks.crash.step=5",
        f"+callbacks.crash.marker={tmp_path / 'crashed'}", f"hydra.run.dir={tmp_path / 'hydra'}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    crashed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert crashed.returncode != 0 and "simulated crash at step 5" in crashed.stderr, crashed.stderr[-3000:]
    assert torch.load(tmp_path / "ddp" / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 4
    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr + resumed.stdout

    ddp = AcceptanceHead.from_pretrained(tmp_path / "ddp")
    torch.testing.assert_close(ddp.state_dict(), reference["module"].head.state_dict(), atol=1e-5, rtol=1e-4)
    assert ddp.meta["training"]["global_step"] == reference["global_step"] == 10  # 5 batches x 2 epochs
    assert ddp.meta["training"]["val_loss_per_epoch"] == pytest.approx(reference["module"].val_loss_per_epoch, rel=1e-5)
    one, two = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "ddp"))
    for split in one:  # reduced over the ranks: every position counted once
        assert two[split]["positions"] == one[split]["positions"]
        assert two[split]["calibration_bins"]["count"] == one[split]["calibration_bins"]["count"]
        for key in ("KL", "KL_const", "ECE"):
            assert two[split][key] == pytest.approx(one[split][key], rel=1e-4, abs=1e-6), (split, key)
        # a rank order of logits: near-tied logits may swap under the heads' float differences
        assert two[split]["AUROC"] == pytest.approx(one[split]["AUROC"], abs=1e-3), split


def test_a_finished_run_is_not_resumed_by_another_training(tiny_dataset, tiny_pair, tmp_path):
    """A finished run leaves last.ckpt; another preset, dataset or seed into the same out must not
    resume it (it would train zero steps and save the old weights under the new record)."""
    def overrides(preset, data=tiny_dataset, *extra):
        return [*base_overrides(tiny_pair, data, tmp_path, "trainer=cpu"), f"+experiment=[wrej6_d3,{preset}]",
                "trainer.max_epochs=2", "~callbacks.progress_bar", "~callbacks.lr_monitor", *extra]

    first = run(train_cfg(overrides("small_data")))
    assert (tmp_path / "head" / "ckpt" / "last.ckpt").is_file() and first["global_step"] == 12
    with pytest.raises(ValueError) as error:
        run(train_cfg(overrides("paper")))
    message = str(error.value)
    for key in ("optimizer.lr: 0.003 there, 5e-05 now", "callbacks.early_stopping.monitor"):
        assert key in message, message
    assert "choose another out=" in message and f"delete {tmp_path / 'head' / 'ckpt'}" in message
    other = save_dataset(tmp_path / "other_data", {"train": random_rows(24, tiny_pair.vocab, 7),
                                                   "dev": random_rows(8, tiny_pair.vocab, 8)},
                         tiny_pair.draft, 32, tiny_pair.vocab)
    with pytest.raises(ValueError, match="differs in: dataset_fingerprint"):
        run(train_cfg(overrides("small_data", other)))
    with pytest.raises(ValueError, match="differs in: data.mix_seed: 0 there, 1 now; data.val_seed: 0 there, 1 now; "
                                         "seed: 0 there, 1 now"):
        run(train_cfg(overrides("small_data", tiny_dataset, "seed=1")))
    again = run(train_cfg(overrides("small_data")))  # the same command: the same run, resumed (done)
    assert again["global_step"] == 12


def test_the_same_draft_by_another_path_is_the_same_setting(tmp_path, monkeypatch):
    """A checkpoint written with the draft named by a relative path resumes when it is named by the
    absolute one (or through a link); another directory, another key or a hub id that differs do not."""
    from train.app import same_setting

    (tmp_path / "cache" / "draft").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    absolute = str(tmp_path / "cache" / "draft")
    assert same_setting("pair.draft", "cache/draft", absolute)
    assert same_setting("pair.draft", "link/draft", "cache/draft")
    assert not same_setting("pair.draft", "other", absolute)
    assert not same_setting("pair.draft", "org/model-a", "org/model-b")  # hub ids, not on disk
    assert not same_setting("data.path", "cache/draft", absolute)  # only the draft's path is resolved
    assert not same_setting("pair.draft", "missing/draft", str(tmp_path / "missing" / "draft"))

"""optimizer.kind: Muon + AdamW (the default) or AdamW for everything, the baseline Muon is measured against."""

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError, load_config
from lmcockpit.core.hardware import memory_estimate
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.model.muon import Muon
from lmcockpit.core.run.folder import read_metrics
from lmcockpit.core.train.optim import build_optimizers

from .helpers import cli, drive_engine, losses, tiny_config

ADAMW = ['optimizer.kind="adamw"', "optimizer.weight_decay=0.1", "optimizer.lr=0.01"]


def test_adamw_holds_every_parameter_and_decays_only_the_matrices():
    cfg = tiny_config(*ADAMW)
    model = GPT(shape_from_config(cfg))
    (opt,) = build_optimizers(model, cfg.optimizer, torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(list(model.parameters()))
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    for group in opt.param_groups:
        assert group["lr"] == group["peak_lr"] == 0.01
        assert group["betas"] == (cfg.optimizer.beta1, cfg.optimizer.beta2)
        # the embedding (also the head) and the blocks' matrices decay; the norms' gains do not
        assert group["weight_decay"] == (0.1 if group["params"][0].ndim == 2 else 0.0)
        assert len({p.ndim for p in group["params"]}) == 1


def test_muon_is_the_default_and_keeps_the_block_matrices():
    cfg = tiny_config()
    assert cfg.optimizer.kind == "muon"
    model = GPT(shape_from_config(cfg))
    adamw, muon = build_optimizers(model, cfg.optimizer, torch.device("cpu"))
    assert isinstance(muon, Muon) and type(adamw) is torch.optim.AdamW
    named = dict(model.named_parameters())
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    assert in_muon == {id(p) for n, p in named.items() if p.ndim == 2 and n.startswith("layers.")}


def test_the_memory_estimate_counts_adams_two_moments_for_every_parameter():
    muon, adamw = tiny_config(), tiny_config(*ADAMW)
    n = memory_estimate.param_counts(adamw)
    assert (n.adamw, n.muon) == (n.total, 0)
    assert memory_estimate.estimate(adamw, "cpu").optimizer == 8 * n.total
    assert memory_estimate.estimate(adamw, "cpu").muon_step == 0
    # Muon keeps one momentum buffer for its matrices where AdamW keeps two
    assert memory_estimate.estimate(muon, "cpu").optimizer == 8 * n.total - 4 * n.matrices


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"optimizer.kind.*'sgd'.*muon.*adamw"):
        load_config("debug", ['optimizer.kind="sgd"'])


@pytest.mark.slow
def test_an_adamw_run_learns_and_says_so_in_its_header(tmp_path):
    logs = []
    engine, events = drive_engine(tiny_config(*ADAMW, "training.max_steps=30", "eval.every=0"), tmp_path / "run",
                                  on_event=lambda e, ev: logs.append(ev.text) if isinstance(ev, P.LogLine) else None)
    assert engine.final_state == P.FINISHED
    curve = losses(events)
    assert sum(curve[-5:]) / 5 < curve[0] - 1.0, curve
    header = [line for line in logs if line.startswith("optimizer:")]
    n = sum(p.numel() for p in GPT(shape_from_config(tiny_config())).parameters())
    assert header == [f"optimizer: adamw: AdamW {n:,} (lr 0.01, betas 0.9/0.95, wd 0.1); cosine schedule, warmup 5"]


@pytest.mark.slow
def test_a_resume_that_changes_the_optimizer_is_refused(tmp_path):
    run = tmp_path / "run"
    engine, _ = drive_engine(tiny_config("training.max_steps=4", "checkpoint.every=4", "eval.every=0"), run)
    assert engine.final_state == P.FINISHED
    for kind in ("adamw", '"adamw"'):
        proc = cli("--run", "--resume", str(run), "--set", "training.max_steps=8", "--set", f"optimizer.kind={kind}")
        assert proc.returncode == 2, proc.stderr
        assert "--set optimizer.kind: cannot change when resuming" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert max(r["step"] for r in read_metrics(run, "step")) == 4  # the run was left as it was

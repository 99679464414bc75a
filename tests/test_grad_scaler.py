"""fp16's loss scaler (precision "auto" on V100, T4, RTX 20xx), on the CPU: torch's
GradScaler("cpu") does what the CUDA one does, around the project's own optimizers and clipping."""

import torch

from lmcockpit.core.config import OptimizerConfig
from lmcockpit.core.model.gpt import GPT, GPTShape
from lmcockpit.core.model.muon import Muon
from lmcockpit.core.train.group import Group
from lmcockpit.core.train.optim import build_optimizers, clip_grad_norm, step_optimizers


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=128, n_layer=2, d_model=32, n_head=4, n_kv_head=2, head_dim=8,
                        mlp_hidden=64, max_seq_len=16))


def train_step(model, opts, scaler, seed: int, overflow: torch.nn.Parameter | None = None) -> bool:
    """The trainer's order: scaled backward, unscale, clip over every gradient, step."""
    torch.manual_seed(seed)
    x = torch.randint(0, 128, (4, 16))
    scaler.scale(model(x, x.roll(-1, 1))).backward()
    if overflow is not None:  # what an fp16 overflow leaves in that gradient
        overflow.grad[0, 0] = float("inf")
    for opt in opts:
        scaler.unscale_(opt)
    norm = clip_grad_norm(model.parameters(), 1.0, Group())
    stepped = step_optimizers(opts, scaler, float(norm))
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    return stepped


def state_of(model, opts) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for opt in opts for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def test_an_overflow_in_muons_gradients_skips_the_step_of_both_optimizers():
    model = tiny_model()
    opts = build_optimizers(model, OptimizerConfig(), torch.device("cpu"))
    muon = opts[1]
    assert isinstance(muon, Muon)
    scaler = torch.amp.GradScaler("cpu")
    assert train_step(model, opts, scaler, seed=1)  # both now have momentum they could move by
    before, scale = state_of(model, opts), scaler.get_scale()

    assert not train_step(model, opts, scaler, seed=2, overflow=muon.param_groups[0]["params"][0])
    after = state_of(model, opts)
    changed = [i for i, (a, b) in enumerate(zip(after, before)) if not torch.equal(a, b)]
    assert len(after) == len(before) and not changed, f"{len(changed)} tensors moved on a skipped step"
    assert scaler.get_scale() == scale / 2  # lowered once, not once per optimizer

    # The scaler is ready for the next step, which both optimizers take.
    assert train_step(model, opts, scaler, seed=3)
    in_muon = {id(p) for p in muon.param_groups[0]["params"]}
    moved = {id(p) for p, b in zip(model.parameters(), before) if not torch.equal(p.detach(), b)}
    assert in_muon <= moved and moved - in_muon  # Muon's matrices and AdamW's parameters

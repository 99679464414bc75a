"""Muon: momentum orthogonalised by Newton–Schulz, for the 2-D matrices inside the blocks.

Each step: Nesterov momentum of the gradient, then 5 quintic Newton–Schulz iterations (bf16 on a GPU,
fp16 on one older than Ampere; coefficients 3.4445, −4.7750, 2.0315) push its singular values into
a band around 1, then the update is scaled by sqrt(max(1, rows/cols)). Matrices of the same shape
are stacked and orthogonalised in one batched call: one call per matrix costs more than a whole
training step on an H100, batched it is under a tenth of one.

Under FSDP each parameter, gradient and momentum buffer is a row shard (a DTensor). Newton–Schulz
needs whole matrices: every rank gathers the full update, orthogonalises all of them and keeps the
rows of its own shard. That repeats the small Newton–Schulz work on every rank instead of sharing
it out, but gives each rank exactly the update one process would compute.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Replicate

NS_COEFFS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco, Gower, arXiv:2505.16932): a quintic per iteration, each
# chosen to be the best at that point of the iteration, with the input scaled down by a safety factor
# of 1.02 so the bf16 iterate's norm cannot exceed 1. Copied from modded-nanogpt's train_gpt.py
# (`polar_express_coeffs`, "computed for num_iters=5, safety_factor=2e-2, cushion=2"). Iterations
# past the fifth repeat the last, which keeps what it has reached (the paper's advice).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02


def ns_coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """(a, b, c) of each of `steps` iterations: "quintic" (the same each time) or "polar_express"."""
    if kind == "quintic":
        return [NS_COEFFS] * steps
    if kind == "polar_express":
        return [POLAR_EXPRESS_COEFFS[min(i, len(POLAR_EXPRESS_COEFFS) - 1)] for i in range(steps)]
    raise ValueError(f'Newton-Schulz coefficients {kind!r}: expected "quintic" or "polar_express"')


def iteration_dtype(device_type: str, capability: tuple[int, int] | None = None, hip: bool = False) -> torch.dtype:
    """What Newton–Schulz iterates in: bf16 on a GPU with bf16 in hardware (compute capability 8.0
    or newer, or ROCm), fp16 on Volta and Turing (7.x), fp32 on a CPU and on GPUs without tensor
    cores (Pascal and older: no tensor cores for fp16 to run on, and GeForce Pascal runs fp16
    arithmetic at a 64th of its fp32 rate).

    Volta and Turing only emulate bf16, slowly, but run fp16 on their tensor cores. fp16's range is
    safe because the iterate is normalised (in fp32) before it is rounded: its spectral norm is at
    most 1 and the quintic keeps it below 1.21, so every entry of X, A = X·Xᵀ and B = b·A + c·A²
    (and every partial sum of their products) stays below 4, four orders of magnitude under fp16's
    largest, 65504. At the small end fp16 rounds an entry x to within max(2⁻¹¹·|x|, 2⁻²⁵) against
    bf16's 2⁻⁸·|x|: closer than the bf16 that newer GPUs iterate in for every |x| above 2⁻¹⁷, and
    below that within 3e-8 of a matrix whose norm is 1. fp16 is 2 bytes like bf16, which is what
    memory_estimate.muon_step_bytes counts for the iterate on any GPU.
    """
    if device_type != "cuda":
        return torch.float32
    if hip or (capability is not None and capability >= (8, 0)):
        return torch.bfloat16
    return torch.float16 if capability is not None and capability >= (7, 0) else torch.float32


def device_iteration_dtype(device: torch.device) -> torch.dtype:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return iteration_dtype(device.type, capability, bool(torch.version.hip))


def normalised(G: torch.Tensor, dtype: torch.dtype, safety: float = 1.0) -> torch.Tensor:
    """G over its Frobenius norm times `safety` (so its spectral norm is at most 1/safety), computed
    in fp32 (or G's wider dtype) and rounded once into `dtype`: a gradient too small or too large
    for fp16 is scaled before it is rounded, and no fp32 copy of the stack is made."""
    wide = torch.promote_types(G.dtype, torch.float32)
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=wide)
    if safety != 1.0:
        norm = norm * safety
    return torch.div(G, norm + 1e-7, out=torch.empty(G.shape, dtype=dtype, device=G.device))


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None,
                  kind: str = "quintic") -> torch.Tensor:
    """Approximately orthogonalise each matrix of G (..., rows, cols); result in `dtype`, by
    default the one `iteration_dtype` picks for G's device.

    The quintic's coefficients trade exactness for speed: singular values land roughly in
    [0.7, 1.2] rather than at 1, which training does not mind. bf16 is the fast path on a GPU's
    tensor cores. On a CPU it depends on the CPU (cpu_precision): a run in bf16 there iterates in
    bf16 (the optimizer is given the dtype), one in fp32 in fp32. `kind` "polar_express" takes
    Polar Express's coefficients, which bring the singular values much closer to 1 in as many
    steps. Its largest, 22.5, keeps B = b·A + c·A² below 40 in fp16 (A's entries are at most 1).
    """
    safety = POLAR_EXPRESS_SAFETY if kind == "polar_express" else 1.0
    X = normalised(G, dtype or device_iteration_dtype(G.device), safety)
    transposed = X.size(-2) > X.size(-1)
    if transposed:  # iterate on the wide form: X @ X.mT is then the smaller Gram matrix
        X = X.mT
    # b·A + c·A², then a·X + B·X, each one fused multiply-add: no separately rounded products, and
    # no temporaries of X's size beside the new iterate (nor a reference kept to the first one).
    fma = torch.baddbmm if X.ndim == 3 else torch.addmm
    for a, b, c in ns_coefficients(kind, steps):
        A = X @ X.mT
        B = fma(A, A, A, beta=b, alpha=c)
        X = fma(X, B, X, beta=a)
    return X.mT if transposed else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None, coefficients: str = "quintic",
                 normuon: bool = False, normuon_beta2: float = 0.95):
        """`ns_dtype`: what Newton–Schulz iterates in; None: `iteration_dtype`'s choice for the device.
        `coefficients`: "quintic" or "polar_express" (newton_schulz); `normuon`: NorMuon's per-neuron
        normalisation (`normuon_scaled`), its second moment a running average with `normuon_beta2`."""
        params = list(params)
        if any(p.ndim != 2 for p in params):
            raise ValueError("Muon takes 2-D matrices only; give vectors and embeddings to AdamW")
        ns_coefficients(coefficients, 1)  # a bad name fails here, not at the first step
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps,
                                      coefficients=coefficients, normuon=normuon, normuon_beta2=normuon_beta2))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
            for shape, params in by_shape.items():
                self._step_shape(shape, params, group)
        return None

    def _step_shape(self, shape: torch.Size, params: list[torch.Tensor], group: dict) -> None:
        """One batched orthogonalisation for every matrix of `shape`; its temporaries die with the
        call, before the next shape's (memory_estimate.muon_step_bytes counts one shape at a time)."""
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        stacked = None  # the updates are written straight into one stack: no list of them beside it
        for i, p in enumerate(params):
            buf = self.state[p].get("momentum_buffer")
            if buf is None:
                buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            buf.lerp_(p.grad, 1 - beta)
            update = _whole(p.grad.lerp(buf, beta))  # Nesterov: look ahead along the momentum
            if stacked is None:
                stacked = update.new_empty((len(params), *update.shape))
            stacked[i] = update
        ortho = newton_schulz(stacked, group["ns_steps"], self.ns_dtype, kind=group.get("coefficients", "quintic"))
        del stacked
        scale = max(1.0, shape[0] / shape[1]) ** 0.5
        for p, u in zip(params, ortho):
            if group.get("normuon"):
                u = normuon_scaled(u, self._second_moment(p), group["normuon_beta2"])
            p, u = _own_part(p, u)
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(u.to(p.dtype), alpha=-lr * scale)

    def _second_moment(self, p: torch.Tensor) -> torch.Tensor:
        """NorMuon's running mean square of each neuron's update, in fp32, the whole of it on every
        rank (a replicated DTensor under FSDP: a checkpoint keeps one copy, resharded freely); every
        rank updates it alike, from the same whole update."""
        state = self.state[p]
        if "second_moment" not in state:
            rows, cols = p.shape
            whole = torch.zeros((rows, 1) if rows >= cols else (1, cols), dtype=torch.float32,
                                device=_local(p).device)
            state["second_moment"] = (DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                                         run_check=False) if isinstance(p, DTensor) else whole)
        return _local(state["second_moment"])


def normuon_scaled(update: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon (Li et al., arXiv:2510.05491; modded-nanogpt's `_apply_normuon_variance_reduction`):
    each neuron's row of the orthogonalised update (a column, for a wide matrix: the smaller side)
    divided by the root of its running mean square, then the whole rescaled to the Frobenius norm it
    had, so only the balance between neurons changes, not the step's size. `second_moment`
    ((rows, 1) or (1, cols), fp32) is updated in place."""
    dim = -1 if update.size(-2) >= update.size(-1) else -2
    u = update.float()
    mean_sq = u.square().mean(dim=dim, keepdim=True)
    second_moment.lerp_(mean_sq, 1 - beta2)
    scaled = u * second_moment.clamp_min(1e-10).rsqrt()
    return scaled * (u.norm() / scaled.norm().clamp_min(1e-10))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _own_part(p: torch.Tensor, full_update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's piece of the parameter, the matching piece of the whole update)."""
    if not isinstance(p, DTensor):
        return p, full_update
    replicated = DTensor.from_local(full_update, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return p.to_local(), replicated.redistribute(p.device_mesh, p.placements).to_local()

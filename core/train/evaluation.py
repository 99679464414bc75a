"""What the trainer measures of the model between steps: validation, task scores, the target, samples.

Each has its cadence (eval.every, eval.tasks_every, sample.every); an evaluation writes one `eval`
row with the validation loss, the task scores or both, and the first to reach the run's target a
`target` row (with stop_at_target, the last step). Samples come from the live weights and touch
no state training reads. Under several processes every rank runs the same passes and the group
sums their counts; rank 0 reports.
"""

from __future__ import annotations

import math
import time

import torch

from .. import protocol as P
from ..config import ConfigError
from ..data import batches
from ..data.chat_rows import IGNORE, ChatRows
from ..model import sampling
from ..run.target import run_time
from ..tasks import catalog as tasks_catalog, items as task_items
from . import memory_probe


class Evaluation:
    def __init__(self, trainer):
        self.trainer = trainer  # the Trainer whose part this is (its module imports this one)
        self.tasks: list = []  # eval.tasks, read in set-up (load_tasks)
        self.target_reached: int | None = None  # the step whose evaluation first met the target

    # ------------------------------------------------------------------------------ tasks
    def load_tasks(self) -> None:
        """eval.tasks read on every rank, and the same everywhere (task_items.agree): the ranks
        score every world-th item and sum the choices. A rank that cannot read them stops them all."""
        tr = self.trainer
        try:
            tasks, local = tasks_catalog.load_tasks(tr.cfg.eval.tasks, tr.cfg), None
        except ConfigError as e:
            tasks, local = [], e
        answers = tr.group.gather(str(local) if local is not None else task_items.Digest(task_items.digest(tasks)))
        if local is not None:
            raise local
        task_items.agree(answers)
        self.tasks = tasks

    def due(self) -> tuple[bool, bool]:
        """Whether this step ends with the validation loss, and with the task scores: each has
        its cadence, the tasks' eval.tasks_every (0: eval.every's)."""
        e, step = self.trainer.cfg.eval, self.trainer.step
        tasks_every = e.tasks_every or e.every
        return (bool(e.every) and step % e.every == 0,
                bool(self.tasks) and bool(tasks_every) and step % tasks_every == 0)

    def evaluate(self, validation: bool = True, tasks: bool = False) -> None:
        """One `eval` row (and EvalMetrics) with the validation loss, the task scores, or both."""
        tr = self.trainer
        tr.emit(P.StateChanged(P.EVALUATING))
        with tr.between.timing("evaluation"):  # within_memory: an out-of-memory error ends the run, explained
            fields = tr.within_memory("validation", self.validation_loss) if validation else {}
        scores: dict[str, dict] = {}
        core = None
        if tasks:
            t0 = time.perf_counter()
            with tr.between.timing("tasks"):
                results = tr.within_memory("tasks", self.score_tasks)
            scores = fields["tasks"] = {name: r.row() for name, r in results.items()}
            core = task_items.core_score(results, self.tasks)
            if core is not None:
                fields["core"] = core
            if tr.group.is_main:  # what a task costs the run, beside what it says
                tr.log(f"tasks: step {tr.step} scored in {time.perf_counter() - t0:.1f} s: " + ", ".join(
                    f"{name} {s['accuracy']:.3f} of {s['items']}" for name, s in scores.items())
                       + ("" if core is None else f"; CORE {core:.4f}"))
        tr.record(P.EvalMetrics(tr.step, fields.get("val_loss"), fields.get("val_bpb"), scores, core))
        self.check_target(fields)
        tr.emit(P.StateChanged(P.PAUSED if tr.paused else P.RUNNING))

    def score_tasks(self) -> dict:
        from ..tasks import scoring

        tr = self.trainer

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tr.tokenizer.encode_batch(texts, add_special_tokens=False)]

        return scoring.score_tasks(self.tasks, tr.model, encode, tr.data.eos_id, tr.cfg.training.seq_len,
                                   tr.cfg.eval_batch_size, tr.device, tr.autocast, tr.group, tr.cfg.eval.max_per_task)

    @torch.no_grad()
    def validation_loss(self) -> dict[str, float]:
        tr = self.trainer
        cfg, t, data, device = tr.cfg, tr.cfg.training, tr.data, tr.device
        # The windows in the run's own batches (the same at every evaluation, whatever a resume
        # changed of the micro-batch), evaluated eval.batch_size of them at a time.
        # Conversations (chat_rows.ChatRows): whole rows, the loss only where the targets are not IGNORE.
        chat = isinstance(data.val, ChatRows)
        windows = (data.val.eval_rows(cfg.eval.batches, tr.data_unit.rows) if chat else
                   batches.eval_windows(len(data.val), cfg.eval.batches, tr.data_unit.rows, t.seq_len)).ravel()
        size = cfg.eval_batch_size
        starts = [windows[i:i + size] for i in range(0, len(windows), size)]
        nats, n_bytes, n_tokens, loss_sum = 0.0, 0, 0, 0.0
        token_bytes = torch.from_numpy(data.token_bytes).to(device)
        g = tr.group
        # Rank r takes batches r, r + world, ...; under FSDP every rank must run as many forward
        # passes as the others (each gathers shards with them), so a rank short of one repeats
        # batch 0 and counts nothing from it.
        rounds = -(-len(starts) // g.world) if g.sharded else len(range(g.rank, len(starts), g.world))
        for i in range(g.rank, g.rank + rounds * g.world, g.world):
            counts = i < len(starts)
            at = starts[i if counts else 0]
            rows = data.val.at(at) if chat else batches.rows_at(data.val, at, t.seq_len)
            x, y = (torch.from_numpy(a).to(device) for a in rows)
            kept = y != IGNORE
            y = y.clamp(min=0)
            with tr.autocast():
                losses = tr.model.token_losses(x, y) * kept  # times 1 where nothing is ignored: the same sums
            if not counts:
                continue
            b = token_bytes[y] * kept
            nats += float((losses * (b > 0)).sum())
            n_bytes += int(b.sum())
            loss_sum += float(losses.sum())
            n_tokens += int(kept.sum())
        totals = g.sum(torch.tensor([nats, n_bytes, n_tokens, loss_sum], dtype=torch.float64, device=device))
        nats, n_bytes, n_tokens, loss_sum = totals.tolist()
        return {"val_loss": loss_sum / n_tokens, "val_bpb": nats / (math.log(2) * max(1, n_bytes))}

    # ----------------------------------------------------------------------------- target
    def check_target(self, fields: dict) -> None:
        """The first evaluation to reach the run's target (a validation loss at or under
        target_val_loss, or target_task's accuracy at or above target_accuracy): a `target` row
        and a log line, and with stop_at_target the last step."""
        tr = self.trainer
        t = tr.cfg.training
        if self.target_reached is not None:
            return
        if t.target_val_loss and fields.get("val_loss") is not None and fields["val_loss"] <= t.target_val_loss:
            what, value, target, key = "val_loss", fields["val_loss"], t.target_val_loss, "training.target_val_loss"
        elif t.target_task and (fields.get("tasks") or {}).get(t.target_task, {}).get("accuracy", -1) >= t.target_accuracy:
            what, value, target = t.target_task, fields["tasks"][t.target_task]["accuracy"], t.target_accuracy
            key = f"training.target_accuracy of {t.target_task}"
        else:
            return
        self.target_reached = tr.step
        # the run's training time so far, resumes included and steps rolled back left out
        seconds = tr.summary.history.time if tr.summary is not None else None
        tr.record(P.TargetReached(tr.step, what, value, target, seconds))
        after = f", after {run_time(seconds)} of training" if seconds is not None else ""
        tr.log(f"target: {what} {value:.4f} reached {key} = {target:g} at step {tr.step}{after}"
               + ("; the run ends here (training.stop_at_target)" if t.stop_at_target else ""))

    @property
    def target_aim(self) -> list:
        """What the run aims at, as a checkpoint records it: a resume aiming elsewhere starts afresh."""
        t = self.trainer.cfg.training
        return [t.target_task, t.target_accuracy] if t.target_task else ["val_loss", t.target_val_loss]

    @property
    def at_target(self) -> bool:
        return self.trainer.cfg.training.stop_at_target and self.target_reached is not None

    def state(self) -> dict:
        return {"target": {"aim": self.target_aim, "reached_at": self.target_reached}}

    def restore(self, state: dict) -> None:
        target = state.get("target") or {}  # reached already, unless the resume aims elsewhere
        if target.get("aim") == self.target_aim:
            self.target_reached = target.get("reached_at")

    # ---------------------------------------------------------------------------- samples
    def sample_text(self, request: P.Sample) -> list[str] | None:
        """From the live weights, between optimizer steps; touches no state that training reads.
        Rank 0 answers; under FSDP the other ranks run the same generation beside it, silently.
        A request that runs out of memory (many rows, a long context) is dropped and training goes
        on; under FSDP every rank decodes in step with the others, so there it ends the run."""
        tr = self.trainer
        if not (tr.group.is_main or tr.group.sharded):
            return None
        answer = lambda: sampling.answer(  # noqa: E731 - a one-line function, defined where it is used
            tr.model, tr.tokenizer, tr.data.eos_id, request, tr.step, tr.emit, tr.log, tr.autocast(),
            tr.group.broadcast if tr.group.sharded else None)
        if tr.group.sharded:
            return tr.within_memory("sampling", answer)
        texts, error = memory_probe.unless_out_of_memory(answer, tr.device, at=("sampling", tr.step))
        if error is None:
            return texts
        error = error.strip().splitlines()[0]
        tr.log(f"warning: sample request {request.request_id!r} ran out of memory ({error}): "
               f"{request.num_samples} row(s) × {request.max_new_tokens} new tokens was dropped; training goes on")
        tr.emit(P.SampleText(request.request_id, tr.step, request.prompt, "", done=True))
        return None

    def answer_sample(self, request: P.Sample) -> None:
        with self.trainer.between.timing("samples"):
            texts = self.sample_text(request) or []
        for text in texts:
            self.trainer.metrics.write(P.Sampled(self.trainer.step, request.prompt, text))

    def periodic_samples(self) -> None:
        tr = self.trainer
        s = tr.cfg.sample
        for i, prompt in enumerate(s.prompts):
            req = P.Sample(f"periodic-{tr.step}-{i}", prompt, s.max_new_tokens, s.temperature, s.top_k,
                           seed=tr.cfg.training.seed + i, top_p=s.top_p)
            with tr.between.timing("samples"):
                texts = self.sample_text(req) or []
            for text in texts:
                tr.metrics.write(P.Sampled(tr.step, prompt, text))
                tr.log(f"sample at step {tr.step}: {prompt + text!r}")

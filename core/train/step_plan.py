"""What the step about to train takes under the batch and sequence-length schedules.

Its micro-batches, sequence length, first batch of data, tokens and FLOPs per token, from
core/step_schedules.py's arithmetic, with a line in the log where a schedule moves to a new stage."""

from __future__ import annotations

from typing import NamedTuple

from ..config import ConfigError
from ..step_schedules import Schedules


class Plan(NamedTuple):
    accum: int  # this process's micro-batches
    seq_len: int
    start: int  # the step's first batch of data (batches.step_rows)
    tokens: int  # every process's
    flops_per_token: float


class StepPlan:
    def __init__(self, trainer):
        """After the data unit is agreed (a resumed run's, from its checkpoint) and the micro-batch
        settled: a schedule's shares must split the step as this run splits it."""
        self.trainer = trainer
        self.schedules = Schedules.of(trainer.cfg, trainer.data_unit.per_step)
        if problem := self.schedules.problem():
            raise ConfigError(problem)
        self.flops: dict[int, float] = {}  # by sequence length: the attention's share grows with it
        self.first = True  # the first step this process trains says where in the schedules it starts

    def seq_len(self, step: int) -> int:
        return self.schedules.seq_len(step)

    def enter(self) -> Plan:
        tr, s = self.trainer, self.schedules
        step = tr.step
        line = s.change(step, resumed_at=step if self.first else None)
        if line and tr.group.is_main:
            tr.log(line)
        self.first = False
        seq_len = s.seq_len(step)
        if seq_len not in self.flops:
            self.flops[seq_len] = tr.model.flops_per_token(seq_len)
        # The data follows the data step (a rollback steps past batches: recovery.batch_offset), the
        # batch's size and length the training step, as the learning rate does.
        return Plan(s.accum_at(step), seq_len, s.first_batch(step + tr.recovery.batch_offset), s.step_tokens(step),
                    self.flops[seq_len])

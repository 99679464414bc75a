"""bench/speedrun.py (gpu_check's `speedrun` part): the record's curve read at equal tokens, and its
CPU rehearsal end to end (the GPU run itself needs a lease; bench/RESULTS.md holds its figures)."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import speedrun  # noqa: E402 - from bench/, put on sys.path above


def test_the_record_s_loss_is_read_at_equal_tokens_between_its_evaluations():
    per_step = speedrun.RECORD_TOKENS_PER_STEP
    assert speedrun.record_loss_at(125 * per_step) == pytest.approx(4.3924)
    # halfway in log-tokens between steps 125 and 250: halfway between their losses
    assert speedrun.record_loss_at((125 * 250) ** 0.5 * per_step) == pytest.approx((4.3924 + 4.0066) / 2)
    assert speedrun.record_loss_at(100 * per_step) is None and speedrun.record_loss_at(2000 * per_step) is None
    # 3.28 falls between its evaluations at steps 1375 (3.3088, 236.2 s) and 1500 (3.2776, 258.8 s)
    assert speedrun.record_seconds_to(3.28) == pytest.approx(236.241 + 22.585 * (3.3088 - 3.28) / (3.3088 - 3.2776))


def test_a_prepared_shard_is_the_first_tokens_of_its_source(tmp_path):
    import numpy as np

    full = speedrun.write_shard(tmp_path / "full.bin", np.arange(1000))
    cut = speedrun.write_shard(tmp_path / "cut.bin", speedrun.first_tokens(full, 300))
    from lmcockpit.core.data import token_shards

    assert token_shards.shard_tokens(cut) == 300
    assert list(token_shards.open_tokens([cut])[0:300]) == list(range(300))


@pytest.mark.slow
def test_the_cpu_rehearsal_trains_the_preset_and_prints_the_table_and_the_projection(tmp_path):
    ok, lines = speedrun.part_speedrun(tmp_path, 600, ["training.max_steps=12", "training.target_val_loss=0.1"],
                                       "cpu")
    text = "\n".join(lines)
    assert ok, text
    assert ("| step | tokens | passes over them | val loss | record at those tokens (2024-12-04_ValueEmbed) | "
            "difference |") in text
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 5", "| 10", "| 12"]  # and the last step's
    assert "projected time to 3.28" in lines[-1] and "core/run/target.py's fit" in lines[-1]

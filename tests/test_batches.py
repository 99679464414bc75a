import numpy as np

from lmcockpit.core.data.batches import eval_windows, get_batch, global_index

TOKENS = np.arange(10_000, dtype=np.uint16)


def test_batch_is_a_pure_function_of_seed_and_index():
    a = get_batch(TOKENS, 7, 123, 4, 16)
    b = get_batch(TOKENS, 7, 123, 4, 16)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(get_batch(TOKENS, 7, 124, 4, 16)[0], a[0])
    assert not np.array_equal(get_batch(TOKENS, 8, 123, 4, 16)[0], a[0])


def test_targets_are_inputs_shifted_by_one():
    x, y = get_batch(TOKENS, 0, 0, 3, 32)
    assert x.shape == y.shape == (3, 32) and x.dtype == np.int64
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert np.array_equal(y - x, np.ones_like(x))  # TOKENS is a ramp: each target is next token


def test_windows_stay_inside_the_stream():
    for g in range(200):
        x, y = get_batch(TOKENS[:40], 1, g, 8, 16)
        assert y.max() <= 39


def test_two_ranks_accum_one_see_the_data_of_one_rank_accum_two():
    def step_batches(world, accum, step):
        return sorted(get_batch(TOKENS, 5, global_index(step, r, m, world, accum), 4, 8)[0].tobytes()
                      for r in range(world) for m in range(accum))

    for step in range(5):
        assert step_batches(2, 1, step) == step_batches(1, 2, step)
    # and the indices of consecutive steps never collide
    seen = {global_index(s, r, m, 2, 3) for s in range(10) for r in range(2) for m in range(3)}
    assert seen == set(range(60))


def test_eval_windows_are_fixed_and_spread():
    w = eval_windows(10_000, 4, 8, 64)
    assert w.shape == (4, 8)
    assert w.min() == 0 and w.max() == 10_000 - 65
    assert np.array_equal(w, eval_windows(10_000, 4, 8, 64))

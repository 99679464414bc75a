"""Sampling: the KV cache against recomputation, seeds, independent rows, filters, end-of-text,
streamed text, and live samples that leave training exactly as it was."""

from contextlib import nullcontext

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.infer.load import load
from lmcockpit.core.model.gpt import GPT, GPTShape, KVCache
from lmcockpit.core.model.sampling import TextStream, answer, filter_logits, generate
from lmcockpit.core.run.checkpoint_folder import find_checkpoint
from lmcockpit.core.run.folder import read_metrics

from .helpers import drive_engine, losses, tiny_config

SHAPE = GPTShape(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, head_dim=8, mlp_hidden=64,
                 max_seq_len=32)


@pytest.fixture(scope="module")
def loaded(trained_run):
    run, proc = trained_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return load(find_checkpoint(str(run)), "cpu")


def tokens(model, prompt_ids, n, **kw) -> list[list[int | None]]:
    return list(generate(model, prompt_ids, n, **kw))


def ask(loaded, prompt: str, **settings) -> tuple[list[str], list[P.SampleText]]:
    events, logs = [], []
    texts = answer(loaded.model, loaded.tokenizer, loaded.eos_id, P.Sample("r", prompt, **settings), loaded.step,
                   events.append, logs.append, nullcontext())
    assert not logs
    return texts, events


@pytest.mark.slow
def test_decode_with_the_cache_gives_the_logits_of_the_full_forward():
    torch.manual_seed(0)
    model = GPT(SHAPE).eval()
    x = torch.randint(0, 97, (3, 20))
    cache = KVCache(SHAPE.n_layer, SHAPE.max_seq_len)
    with torch.no_grad():
        full = model(x).float()
        stepwise = [model.decode(x[:, :8], cache)] + [model.decode(x[:, t:t + 1], cache) for t in range(8, 20)]
    assert cache.length == 20
    for i, logits in enumerate(stepwise):
        torch.testing.assert_close(logits, full[:, 7 + i], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cached_greedy_equals_recomputation_past_the_context(loaded):
    ids = loaded.tokenizer.encode("def fibonacci(n):").ids
    n = 2 * loaded.model.shape.max_seq_len  # the visible window moves twice
    cached = tokens(loaded.model, ids, n, greedy=True)
    recomputed = tokens(loaded.model, ids, n, greedy=True, use_cache=False)
    assert len(cached) == n and cached == recomputed


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_cropped(loaded):
    ctx = loaded.model.shape.max_seq_len
    ids = loaded.tokenizer.encode("import os\n" * ctx).ids
    assert len(ids) > ctx
    out = tokens(loaded.model, ids, 10, greedy=True)
    assert out == tokens(loaded.model, ids[-ctx:], 10, greedy=True)


@pytest.mark.slow
def test_same_seed_same_text_other_seed_other_text(loaded):
    settings = dict(max_new_tokens=24, temperature=1.0, top_k=0)
    a, _ = ask(loaded, "def ", seed=1, **settings)
    b, _ = ask(loaded, "def ", seed=1, **settings)
    c, _ = ask(loaded, "def ", seed=2, **settings)
    assert a == b and a != c


def test_each_row_draws_its_own_first_token():
    # A zero final norm makes every logit 0: the first token is uniform over 4096 ids, so eight rows
    # sharing one draw would show as eight equal tokens (chance 4096**-7 if drawn independently).
    model = GPT(GPTShape(vocab_size=4096, n_layer=1, d_model=32, n_head=2, n_kv_head=1, head_dim=16,
                         mlp_hidden=64, max_seq_len=16)).eval()
    with torch.no_grad():
        model.norm.weight.zero_()
    first = tokens(model, [1, 2, 3], 1, temperature=1.0, num_samples=8, seed=0)[0]
    assert len(first) == 8 and len(set(first)) > 1


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, 1.0, **kw))[0].tolist()  # noqa: E731 - a one-line function, defined where it is used
    assert kept(top_k=2, top_p=1.0) == [True, True, False, False]
    assert kept(top_k=0, top_p=0.8) == [True, True, False, False]
    assert kept(top_k=0, top_p=0.81) == [True, True, True, False]
    assert kept(top_k=0, top_p=1e-6) == [True, False, False, False]
    assert kept(top_k=0, top_p=1.0) == [True] * 4


@pytest.mark.slow
def test_top_k_1_and_a_tiny_top_p_are_greedy(loaded):
    ids = loaded.tokenizer.encode("class ").ids
    greedy = tokens(loaded.model, ids, 20, greedy=True, num_samples=2)
    assert tokens(loaded.model, ids, 20, temperature=1.5, top_k=1, num_samples=2, seed=5) == greedy
    assert tokens(loaded.model, ids, 20, temperature=1.5, top_p=1e-6, num_samples=2, seed=6) == greedy


def test_generation_stops_at_end_of_text(loaded):
    ids = loaded.tokenizer.encode("def ").ids
    first = tokens(loaded.model, ids, 1, greedy=True)[0][0]
    assert tokens(loaded.model, ids, 20, greedy=True, eos_id=first) == [[None]]


def test_rows_that_meet_end_of_text_drop_out_and_the_others_go_on():
    model = GPT(GPTShape(vocab_size=4, n_layer=1, d_model=32, n_head=2, n_kv_head=1, head_dim=16,
                         mlp_hidden=64, max_seq_len=64)).eval()
    with torch.no_grad():
        model.norm.weight.zero_()  # uniform over 4 tokens: each step ends a row with chance 1/4
    steps = tokens(model, [1], 60, temperature=1.0, num_samples=8, seed=0, eos_id=0)
    rows = list(zip(*steps))
    lengths = [sum(t is not None for t in row) for row in rows]
    assert all(None not in row[:n] and set(row[n:]) <= {None} for row, n in zip(rows, lengths))
    assert len(set(lengths)) > 1 and len(steps) < 60 and steps[-1] == [None] * 8


@pytest.mark.slow
def test_streamed_pieces_join_to_the_text_without_broken_characters(loaded):
    tok = loaded.tokenizer
    text = "naïve café → 🙂 ok, 漢字 done"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # byte-level: the rare characters span several tokens
    stream = TextStream(tok.decode)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some tokens ended mid-character and were held back

    prompt_ids = tok.encode("def ").ids
    greedy_ids = [t for (t,) in tokens(loaded.model, prompt_ids, 20, greedy=True, eos_id=loaded.eos_id)]
    assert ask(loaded, "def ", greedy=True, max_new_tokens=20)[0] == [tok.decode([t for t in greedy_ids if t is not None])]

    texts, events = ask(loaded, "def ", num_samples=3, temperature=1.0, max_new_tokens=30, seed=3)
    assert events[-1].done and sum(e.done for e in events) == 1
    for row in range(3):
        assert "".join(e.text for e in events if e.row == row and not e.done) == texts[row]


def test_sampling_leaves_the_random_state_and_the_mode_alone(loaded):
    loaded.model.train()
    before = torch.get_rng_state()
    ask(loaded, "def ", temperature=1.0, max_new_tokens=8, num_samples=2)
    assert torch.equal(before, torch.get_rng_state())
    assert loaded.model.training
    loaded.model.eval()


def test_a_request_with_nonsense_settings_is_refused_and_still_done(loaded):
    events, logs = [], []
    out = answer(loaded.model, loaded.tokenizer, loaded.eos_id, P.Sample("bad", "x", temperature=-1.0), 3,
                 events.append, logs.append, nullcontext())
    assert out is None and "temperature" in logs[0]
    assert events == [P.SampleText("bad", 3, "x", "", done=True)]


@pytest.mark.slow
def test_periodic_samples_take_top_p_from_the_config(tmp_path):
    """A nucleus of one token (top_p 1e-6) is greedy whatever the temperature: the run's last
    periodic sample, drawn from the weights its last checkpoint holds, is their greedy text,
    where the same draw without top_p is not."""
    cfg = tiny_config("training.max_steps=2", "eval.every=0", "sample.prompts=[\"def \"]", "sample.top_p=1e-6",
                      "sample.temperature=2.0", "sample.top_k=0", "sample.max_new_tokens=16")
    engine, _ = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FINISHED, engine.failure
    [periodic] = read_metrics(tmp_path / "run", "sample")
    assert periodic["step"] == 2 and periodic["prompt"] == "def "
    loaded = load(find_checkpoint(str(tmp_path / "run")), "cpu")
    assert loaded.step == 2
    [greedy], _ = ask(loaded, "def ", greedy=True, max_new_tokens=16)
    [drawn], _ = ask(loaded, "def ", temperature=2.0, top_k=0, seed=cfg.training.seed, max_new_tokens=16)
    assert drawn != greedy  # so the top_p is what made the periodic sample greedy
    assert periodic["text"] == greedy

    assert tiny_config("sample.top_p=0.9").sample.top_p == 0.9
    for bad in ("sample.top_p=0", "sample.top_p=1.5"):
        with pytest.raises(ConfigError, match=r"sample.top_p .* must be in \(0, 1\]"):
            tiny_config(bad)


@pytest.mark.slow
def test_training_losses_are_identical_with_samples_in_between(tmp_path):
    """Chat requests while running and while paused, and periodic samples: same losses, bit for bit."""
    base = ["eval.every=0"]
    paused = []

    def interleave(engine, ev):
        if isinstance(ev, P.StepMetrics) and ev.step == 1:
            engine.send(P.Sample("a", "def ", max_new_tokens=12, num_samples=3, top_p=0.9, seed=4))
            engine.send(P.Pause())
        elif isinstance(ev, P.StateChanged) and ev.state == P.PAUSED and not paused:
            paused.append(ev)
            engine.send(P.Sample("b", "import ", max_new_tokens=8, greedy=True))
            engine.send(P.Sample("c", "class ", max_new_tokens=8, temperature=1.0))
            engine.send(P.Resume())

    plain = losses(drive_engine(tiny_config(*base), tmp_path / "plain")[1])
    engine, events = drive_engine(tiny_config(*base, "sample.every=4", 'sample.prompts=["def "]'),
                                  tmp_path / "sampled", interleave)
    assert engine.final_state == P.FINISHED and paused
    assert losses(events) == plain and len(plain) == 12
    done = {e.request_id for e in events if isinstance(e, P.SampleText) and e.done}
    assert done == {"a", "b", "c", "periodic-4-0", "periodic-8-0", "periodic-12-0"}
    assert {e.row for e in events if isinstance(e, P.SampleText) and e.request_id == "a"} == {0, 1, 2}
    rows = read_metrics(tmp_path / "sampled", "sample")
    assert {4, 8, 12} <= {r["step"] for r in rows if r["prompt"] == "def "}
    assert sum(r["prompt"] == "def " for r in rows) >= 3 + 3  # request a's three rows, periodic at 4, 8, 12
    assert any(isinstance(e, P.LogLine) and e.text.startswith("sample at step 4: ") for e in events)


def test_agree_makes_every_row_take_the_agreed_tokens_and_stop_together():
    """Under FSDP every rank decodes beside rank 0 and must take rank 0's tokens (the group's
    broadcast); here the agreed tokens are end-of-text after two steps, whatever this model drew,
    so generation stops there for every row."""
    torch.manual_seed(0)
    model = GPT(SHAPE).eval()
    agreed = iter([[5, 6], [7, 8], [3, 3]])
    seen = []

    def agree(nxt: torch.Tensor) -> torch.Tensor:
        seen.append(nxt.tolist())
        return torch.tensor(next(agreed), device=nxt.device)

    out = list(generate(model, [1, 2], 10, num_samples=2, seed=0, eos_id=3, agree=agree))
    assert out == [[5, 6], [7, 8], [None, None]] and len(seen) == 3

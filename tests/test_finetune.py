"""Fine-tuning from a checkpoint (#54): --from, the loss on the assistant's tokens only, the embedding
grown for the turn tokens, the starting weights scored at step 0, an exact resume, the errors.

One tiny base run (its tokenizer made before the turn tokens were reserved, so the common growth
path is the one taken) and one fine-tuning run through the CLI serve every test that starts a
process; the errors stop before any engine starts."""

import math
import os
import pickle
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from lmcockpit.core.config import ConfigError, load_config
from lmcockpit.core.data import batches, chat_template
from lmcockpit.core.data.base_model import plan_from
from lmcockpit.core.data.chat_data import grown_vocab
from lmcockpit.core.data.chat_rows import IGNORE, ChatRows
from lmcockpit.core.model.gpt import GPT, GPTShape
from lmcockpit.core.run.folder import read_metrics
from lmcockpit.core.train.finetune import grown_embedding, vocabulary_table

from .helpers import as_flags, cli, drive_engine, one_error, tiny_config
from .helpers_chat import arithmetic_conversations, bpe_without_turn_tokens, trained_bpe

BASE_VOCAB = 400
BASE = ["training.max_steps=6", "checkpoint.every=3", "eval.every=3", "eval.batches=2", "data.max_bytes=300_000",
        f"tokenizer.vocab_size={BASE_VOCAB}"]
# chat-cpu shrunk to the base's shape (the debug preset's), a few steps
FINE_TUNE = ["model.n_layer=2", "model.d_model=64", "model.mlp_hidden=0", "model.max_seq_len=64", "training.seq_len=64",
             "training.micro_batch_size=8", "training.compile=false", "training.max_steps=8",
             "optimizer.warmup_steps=2", "checkpoint.every=4", "checkpoint.keep=5", "eval.every=4", "eval.batches=2",
             "data.val_fraction=0.2", 'hardware.device="cpu"', "sample.prompts=[]",
             'model.mlp="swiglu"', "model.value_embeds=0", "model.unet_skips=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base")
    bpe_without_turn_tokens(root / "tokenizer", BASE_VOCAB)
    run = root / "run"
    engine, _ = drive_engine(tiny_config(*BASE, f'tokenizer.kind="{root / "tokenizer"}"'), run)
    assert engine.final_state == "finished"
    return run


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return arithmetic_conversations(tmp_path_factory.mktemp("chats") / "chat.jsonl")


def fine_tune_flags(conversations: Path, *extra: str) -> list[str]:
    return as_flags([*FINE_TUNE, f'data.source="{conversations}"', *extra])


@pytest.fixture(scope="module")
def finetuned(base, conversations, tmp_path_factory):
    out = tmp_path_factory.mktemp("finetuned") / "run"
    proc = cli("--run", "chat-cpu", "--from", str(base), *fine_tune_flags(conversations), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def step_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run, "step")}


# ------------------------------------------------------------------------------ the loss, masked
def tiny_model(vocab: int = 97) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=vocab, n_layer=1, d_model=32, n_head=2, n_kv_head=1, head_dim=16, mlp_hidden=64,
                        max_seq_len=16))


def masked_targets(vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (3, 16), generator=g)
    y = torch.randint(0, vocab, (3, 16), generator=g)
    y[:, :5] = IGNORE  # a prompt
    y[1] = IGNORE  # a row with nothing to learn
    y[2, -3:] = IGNORE  # padding
    return x, y


def test_the_fused_loss_equals_the_plain_one_on_masked_targets_values_and_gradients():
    x, y = masked_targets()
    fused_model, plain_model = tiny_model(), tiny_model()
    fused = fused_model(x, y)  # grad enabled, not compiling: LinearCrossEntropy
    fused.backward()
    logits = plain_model(x)  # the plain path: logits, then F.cross_entropy with ignore_index
    plain = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE)
    plain.backward()
    assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6)
    for (name, a), (_, b) in zip(fused_model.named_parameters(), plain_model.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name
    with torch.no_grad():  # the model's own plain path (no gradients wanted) agrees too
        assert torch.allclose(plain_model(x, y), plain, rtol=1e-6, atol=1e-6)


def test_the_loss_is_the_mean_over_the_counted_targets_only():
    x, y = masked_targets()
    model = tiny_model()
    kept = y != IGNORE
    with torch.no_grad():
        each = model.token_losses(x, y.clamp(min=0))
    expected = each[kept].mean()
    assert torch.allclose(model(x, y), expected, rtol=1e-6)
    # what is ignored has no effect at all: other ids there give the same loss and gradients
    other = y.clone()
    other[~kept] = 5
    other_kept = torch.where(kept, other, torch.full_like(other, IGNORE))
    a, b = tiny_model(), tiny_model()
    a(x, y).backward()
    b(x, other_kept).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_batches_of_conversation_rows_are_the_rows_own():
    ids = np.arange(4 * 9, dtype=np.uint16).reshape(4, 9)
    mask = np.zeros((4, 9), dtype=np.uint8)
    mask[:, 5:] = 1
    rows = ChatRows(ids, mask)
    x, y = batches.get_batch(rows, 7, 3, 5, 8)
    ex, ey = rows.batch(7, 3, 5)
    assert np.array_equal(x, ex) and np.array_equal(y, ey)
    assert (y[:, :4] == IGNORE).all() and (y[:, 4:] != IGNORE).all()
    assert rows.tokens == 4 * 8


# ----------------------------------------------------------------------------- the vocabulary
def test_a_tokenizer_without_the_turn_tokens_grows_and_one_with_them_does_not(tmp_path):
    bpe_without_turn_tokens(tmp_path / "old", 300)
    assert grown_vocab(tmp_path / "old" / "tokenizer.json", 300) == (304, 4)
    # a pretrained vocabulary's embedding is often padded: rows past its last id hold the new ones
    assert grown_vocab(tmp_path / "old" / "tokenizer.json", 320) == (320, 4)
    trained_bpe(tmp_path / "new", 300)  # reserves them (ids 1-4)
    assert grown_vocab(tmp_path / "new" / "tokenizer.json", 300) == (300, 0)


def test_new_embedding_rows_start_at_the_mean_of_the_old():
    weight = torch.randn(10, 4)
    grown = grown_embedding(weight, 13)
    assert grown.shape == (13, 4) and torch.equal(grown[:10], weight)
    assert torch.allclose(grown[10:], weight.mean(dim=0).expand(3, 4))
    assert grown_embedding(weight, 10) is weight
    with pytest.raises(ConfigError, match="more than this run's tokenizer.vocab_size"):
        grown_embedding(weight, 8)


def test_every_weight_with_a_row_per_token_grows_with_the_vocabulary():
    # An untied head and value embeddings (the speedrun's model options) are vocabulary tables too:
    # a base with them, fine-tuned with the turn tokens added, needs each grown, or its weights do not load.
    shape = GPTShape(vocab_size=37, n_layer=2, d_model=16, n_head=2, n_kv_head=1, head_dim=8, mlp_hidden=32,
                     max_seq_len=8, tie_embeddings=False, value_embeds=1)
    tables = {name for name, p in GPT(shape).named_parameters() if p.shape[0] == 37}
    assert tables == {"embed_tokens.weight", "lm_head.weight", "value_embeds.0.weight"}
    assert {name for name, _ in GPT(shape).named_parameters() if vocabulary_table(name)} == tables


# ------------------------------------------------------------------------------ the plan (no engine)
@pytest.mark.slow
def test_from_a_run_folder_takes_its_latest_checkpoint_and_from_a_checkpoint_folder_that_one(base, conversations):
    cfg, _ = load_config("chat-cpu", [*FINE_TUNE, f'data.source="{conversations}"'])
    latest = plan_from(cfg, str(base))
    assert latest.training.from_checkpoint == str((base / "checkpoints" / "step_000006").resolve())
    assert latest.training.from_step == 6
    assert latest.tokenizer.vocab_size == BASE_VOCAB + len(chat_template.TURN_TOKENS)
    assert latest.tokenizer.kind.endswith("tokenizer")  # the base's tokenizer, not the preset's
    earlier = plan_from(cfg, str(base / "checkpoints" / "step_000003"))
    assert (earlier.training.from_checkpoint, earlier.training.from_step) == (
        str((base / "checkpoints" / "step_000003").resolve()), 3)


# ------------------------------------------------------------------------------ a fine-tuning run
@pytest.mark.slow
def test_a_fine_tuning_run_starts_from_its_bases_weights_with_the_turn_tokens_added(base, finetuned):
    out, proc = finetuned
    cfg = tomllib.loads((out / "config.toml").read_text())
    ckpt = (base / "checkpoints" / "step_000006").resolve()
    assert cfg["training"]["from_checkpoint"] == str(ckpt) and cfg["training"]["from_step"] == 6
    assert cfg["data"]["format"] == "chat"
    grown = BASE_VOCAB + len(chat_template.TURN_TOKENS)
    assert cfg["tokenizer"]["vocab_size"] == grown
    assert f"fine-tuning from {ckpt} at step 6" in proc.stdout
    assert f"embedding grown from {BASE_VOCAB} to {grown} rows" in proc.stdout
    # the run's own tokenizer: the base's ids, then the turn tokens after its last
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    base_tok = Tokenizer.from_file(str(base / "tokenizer" / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in chat_template.TURN_TOKENS] == list(range(BASE_VOCAB, grown))
    assert all(tok.token_to_id(t) == i for t, i in base_tok.get_vocab().items())
    weights = load_file(str(out / "checkpoints" / "step_000008" / "model.safetensors"))
    assert weights["embed_tokens.weight"].shape[0] == grown
    # the starting weights scored before the first step: the base's, far below a fresh model's ln(V)
    evals = {r["step"]: r for r in read_metrics(out, "eval")}
    assert sorted(evals) == [0, 4, 8]
    assert evals[0]["val_loss"] < math.log(grown) - 0.3
    assert "eval step 0 |" in proc.stdout
    assert sorted(step_losses(out)) == list(range(1, 9))


@pytest.mark.slow
def test_the_last_line_and_compare_say_the_base_and_the_chat_task_s_gain(base, finetuned):
    """What fine-tuning did, where a user looks: the run's last line and `compare BASE FINETUNED`
    give the chat-form task's score at step 0 (the base's weights) and at the end, and the base."""
    out, proc = finetuned
    scores = [r["tasks"]["python-functions-chat"]["accuracy"] for r in read_metrics(out, "eval") if r.get("tasks")]
    first, last = scores[0], scores[-1]
    gain = f"python-functions-chat {first:.3f} → {last:.3f} ({last - first:+.3f})"
    finished = [line for line in proc.stdout.splitlines() if line.startswith("finished ")]
    assert finished and gain in finished[0] and finished[0].endswith(f"; fine-tuned from {base.name} at step 6")
    compared = cli("compare", str(base), str(out))
    assert compared.returncode == 0, compared.stderr
    lines = compared.stdout.splitlines()
    assert f"fine-tuned from\t–\t{base.name} at step 6" in lines
    assert f"python-functions-chat accuracy\t{first:.3f} (step 0 of {out.name})\t{gain.split(' ', 1)[1]}" in lines


@pytest.mark.slow
def test_a_fine_tuning_run_resumes_bit_exactly_from_its_own_checkpoint(finetuned, tmp_path):
    out, _ = finetuned
    continued = tmp_path / "continued"
    proc = cli("--run", "--resume", str(out / "checkpoints" / "step_000004"), "--out", str(continued))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fine-tuning from" not in proc.stdout  # its own checkpoint, never the base again
    ref, got = step_losses(out), step_losses(continued)
    assert sorted(got) == [5, 6, 7, 8]
    assert all(got[s] == ref[s] for s in got), "per-step losses differ after resume"
    assert 0 not in {r["step"] for r in read_metrics(continued, "eval")}
    a = load_file(str(out / "checkpoints" / "step_000008" / "model.safetensors"))
    b = load_file(str(continued / "checkpoints" / "step_000008" / "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_f_on_a_past_run_in_the_launch_screen_fine_tunes_it_with_the_chosen_chat_preset(base, conversations,
                                                                                             tmp_path):
    """A past run, then f: with a pretraining preset chosen, chat-cpu as shipped (whose shape this
    tiny base lacks: said, nothing started); with chat-cpu chosen and edited, a fine-tuning run from
    the run's latest checkpoint, whose dashboard says so."""
    from lmcockpit.tui.app import CockpitApp
    from lmcockpit.tui.widgets.panels import Panel

    from .helpers import dashboard, shown_in, wait_for

    runs = tmp_path / "runs"
    shutil.copytree(base, runs / "base")
    app = CockpitApp(runs_root=runs, telemetry=False)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            launch = app.screen
            launch.query_one("#runs").focus()
            await pilot.press("f")
            await app.preparing.wait()
            await pilot.pause()
            assert app.screen is launch and not app.engines
            assert any("model.n_layer = 4 here but 2 in the base model" in n.message for n in app._notifications)
            presets = launch.query_one("#presets")
            presets.move_cursor(row=presets.get_row_index("chat-cpu"))
            await wait_for(pilot, lambda: launch.preset_name == "chat-cpu", what="chat-cpu chosen")
            launch.overrides = dict(s.split("=", 1) for s in [*FINE_TUNE, f'data.source="{conversations}"'])
            launch.query_one("#runs").focus()
            await pilot.press("f")
            await app.preparing.wait()
            await pilot.pause()
            dash = dashboard(app)
            await wait_for(pilot, lambda: dash.view.state == "finished", timeout=240, what="the fine-tuning run to end")
            cfg = tomllib.loads((dash.engine.run_dir / "config.toml").read_text())
            assert cfg["training"]["from_checkpoint"] == str((runs / "base" / "checkpoints" / "step_000006").resolve())
            assert dash.engine.run_dir.parent == runs and dash.engine.run_dir.name.startswith("chat-cpu-")
            assert 0 in {r["step"] for r in read_metrics(dash.engine.run_dir, "eval")}
            await pilot.pause()
            assert any("fine-tuned from base at step 6" in " ".join(line.split())
                       for line in shown_in(app, dash.query_one("#state", Panel)))
    finally:
        app.stop_runs(timeout=60)


def tmux(sock: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["tmux", "-S", str(sock), *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_in_tmux_the_chat_pane_holds_a_two_turn_conversation_with_the_live_fine_tuning_model(base, conversations,
                                                                                          tmp_path):
    """The cockpit in a real tmux at 80x24, fine-tuning from a tiny base: t opens the chat pane, two
    turns are answered by the weights training now (each reply marked with its step), and the
    80x24 screen shows both turns under the pane's title."""
    import sys
    import time

    from lmcockpit.core import protocol as P
    from lmcockpit.core.process import live
    from lmcockpit.core.process.viewer import RunViewer

    assert shutil.which("tmux"), "no `tmux` on PATH (apt-get install tmux; .ci/run installs it)"
    sock, run = tmp_path / "tmux", tmp_path / "run"
    command = [sys.executable, "-m", "lmcockpit.tui.cli", "chat-cpu", "--from", str(base), "--out", str(run),
               *fine_tune_flags(conversations, "training.max_steps=100000", "eval.every=0", "checkpoint.every=0",
                                'sample.prompts=[]', "sample.max_new_tokens=8")]
    tmux(sock, "-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24", shlex.join(command))

    def screen() -> str:
        return tmux(sock, "capture-pane", "-p")

    def until(condition, what: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while not condition(shown := screen()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{shown}"
            time.sleep(0.2)  # tmux's screen polled: no event to wait on from outside it
        return shown

    def turn(text: str, n: int) -> str:
        """Type a turn; the pane refuses one while the reply before it still comes: typed again then."""
        while True:
            tmux(sock, "send-keys", "-l", text)
            tmux(sock, "send-keys", "Enter")
            shown = until(lambda s: s.count("you ") == n or "still answering" in s, f"turn {n}")
            if "still answering" not in shown:
                return until(lambda s: s.count("(step ") == n, f"reply {n}")
            until(lambda s: "still answering" not in s, "the note to go")

    try:
        until(lambda s: re.search(r"step [1-9]\d*/100000", s), "training to start")
        tmux(sock, "send-keys", "t")
        until(lambda s: "chat · Esc leaves the prompt" in s, "the chat pane")
        turn("Add 2 and 3.", 1)
        shown = turn("Now double it.", 2)
        lines = shown.splitlines()
        assert len(lines) <= 24 and max(map(len, lines)) <= 80
        assert "you   Add 2 and 3." in shown and "you   Now double it." in shown, shown
        assert shown.index("Add 2 and 3.") < shown.index("Now double it."), shown
        assert "chat model" in shown and shown.count("model ") - shown.count("chat model") == 2, shown
    finally:
        for found in live.live_runs():
            if found.run_dir.resolve() == run.resolve() and found.live:
                viewer = RunViewer(found.run_dir)
                viewer.send(P.Abort(save=False))
                viewer.join(120)
                viewer.close()
        tmux(sock, "kill-server")


# ------------------------------------------------------------------------------ errors: one line, exit 2
@pytest.mark.slow
def test_from_errors_are_one_line_before_any_engine_starts(base, conversations, tmp_path):
    out = tmp_path / "never"
    flags = [*fine_tune_flags(conversations), "--out", str(out)]
    one_error(cli("--run", "chat-cpu", "--from", str(tmp_path / "nowhere"), *flags),
              "--from", "no such run folder or checkpoint folder")
    one_error(cli("--run", "chat-cpu", "--from", str(tmp_path), *flags), "neither a run folder")
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    (empty_run / "config.toml").write_text((base / "config.toml").read_text())
    one_error(cli("--run", "chat-cpu", "--from", str(empty_run), *flags), "no complete checkpoint")
    one_error(cli("--run", "chat-cpu", "--from", str(base), *flags, "--set", "model.d_model=128"),
              "model.d_model = 128 here but 64 in the base model")
    # the speedrun's options change what the weights compute (or hold): a base's must be kept too
    one_error(cli("--run", "chat-cpu", "--from", str(base), *flags, *as_flags(['model.mlp="relu2"', "model.mlp_hidden=192"])),
              "model.mlp = relu2 here but swiglu in the base model")
    one_error(cli("--run", "chat-cpu", *flags), "fine-tunes a base model", "--from")
    one_error(cli("--run", "debug", "--from", str(base), "--out", str(out)), 'data.format = "chat"')
    one_error(cli("--run", "--resume", str(base), "--from", str(base)), "--from", "--resume")
    assert not out.exists()
    # its rows are packed by the base's tokenizer: no cache to prepare ahead without one
    one_error(cli("data", "prepare", "chat-cpu"), 'data.format = "chat"', "--from")


class RunsCommand:
    """Unpickled, runs `command`: what a crafted checkpoint's metadata would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.slow
def test_a_base_checkpoint_whose_metadata_runs_a_command_is_refused_unread(base, conversations, tmp_path):
    ckpt = tmp_path / "crafted"
    shutil.copytree(base / "checkpoints" / "step_000006", ckpt)
    metadata_file = ckpt / "train_state" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # this suite's own file: fine to unpickle here
    marker = tmp_path / "ran"
    metadata.storage_meta.modules = [RunsCommand(f"touch {shlex.quote(str(marker))}")]
    metadata_file.write_bytes(pickle.dumps(metadata))
    out = tmp_path / "never"
    one_error(cli("--run", "chat-cpu", "--from", str(ckpt), *fine_tune_flags(conversations), "--out", str(out)),
              "names posix.system, which no lmcockpit checkpoint holds: refused (nothing in it was run)")
    assert not marker.exists() and not out.exists()

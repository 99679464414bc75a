import re
from pathlib import Path

import pytest

from lmcockpit.core.config import Config, ConfigError, load_config, parse_override, shipped_presets

from .helpers import cli


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "preset.toml"
    p.write_text(text)
    return p


def test_shipped_presets_load_and_are_named():
    """A shipped preset is its file, named for it: every value the TOML sets is the config's, and
    every key it leaves out is the default."""
    import tomllib

    from lmcockpit.core.hardware import memory_estimate

    shipped = shipped_presets()
    assert {"cpu", "debug"} <= set(shipped)
    defaults = Config().to_dict()
    for name in shipped:
        cfg, path = load_config(name)
        assert path == shipped[name] and Path(path).stem == name
        written = tomllib.loads(Path(path).read_text())
        got = cfg.to_dict()
        assert got.keys() == defaults.keys()
        for section in defaults:
            assert set(written.get(section, {})) <= set(got[section]), (name, section)
            for key, default in defaults[section].items():
                assert got[section][key] == written.get(section, {}).get(key, default), (name, section, key)
    # the README's figures for the embedded default
    cpu, _ = load_config("cpu")
    assert memory_estimate.param_counts(cpu).total == 6_032_134 and cpu.tokens_per_step == 4096
    assert (cpu.model.n_layer, cpu.model.d_model, cpu.model.n_head, cpu.model.n_kv_head) == (4, 256, 4, 2)
    assert (cpu.training.max_steps, cpu.training.compile, cpu.hardware.device) == (360, True, "auto")


def test_preset_by_relative_path_works_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no presets/ folder here: falls back to the shipped one
    cfg, path = load_config("presets/cpu.toml")
    assert path == shipped_presets()["cpu"]
    assert cfg.model.d_model == 256


def test_set_overrides_use_toml_values():
    cfg, _ = load_config("debug", ["training.max_steps=7", "training.compile=true", "optimizer.lr=1e-3",
                                   "data.source=\"/x/y\"", "sample.prompts=[\"a\", \"b\"]", "data.text_field=body"])
    assert cfg.training.max_steps == 7 and cfg.training.compile is True
    assert cfg.optimizer.lr == 1e-3 and cfg.data.source == "/x/y"
    assert cfg.sample.prompts == ["a", "b"] and cfg.data.text_field == "body"


def test_int_is_accepted_for_float_keys_and_stored_as_float():
    cfg, _ = load_config("debug", ["optimizer.lr=1"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize("item", ["training.max_steps", "max_steps=3", "a.b.c=1", "training.seed=[1,"])
def test_malformed_set_is_a_config_error(item):
    with pytest.raises(ConfigError, match="--set"):
        parse_override(item)


def test_unknown_key_names_the_closest(tmp_path):
    p = write(tmp_path, "[training]\nmax_step = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert str(p) in str(e.value) and "training.max_step" in str(e.value)
    assert "did you mean training.max_steps" in str(e.value)


def test_unknown_section_names_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[traning\].*did you mean training"):
        load_config(str(write(tmp_path, "[traning]\nmax_steps = 3\n")))


def test_toml_syntax_error_has_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match=r"TOML syntax error.*line 2, column"):
        load_config(str(write(tmp_path, "[training]\nmax_steps = = 3\n")))


@pytest.mark.parametrize("override, message", [
    ("training.max_steps=\"ten\"", "training.max_steps must be an integer, got a string"),
    ("training.compile=1", "training.compile must be true or false"),
    ("training.precision=\"fp8\"", "training.precision = 'fp8' is not one of"),
    ("training.max_steps=-5", "training.max_steps = -5 must be a positive integer"),
    ("model.n_kv_head=3", "model.n_kv_head = 3 must divide model.n_head = 4"),
    ("model.n_head=6", "model.n_head = 6 must divide model.d_model = 64"),
    ("training.seq_len=1000", "above the model's context, model.max_seq_len = 64"),
    ("model.max_seq_len=-1", "model.max_seq_len = -1 must be 0 or more"),
    ("hardware.device=\"gpu\"", "hardware.device = 'gpu' must be"),
    ("distributed.nnodes=0", "distributed.nnodes = 0 must be a positive integer"),
    ("distributed.strategy=\"zero\"", "distributed.strategy = 'zero' is not one of"),
    # each once crashed the run, or trained it to NaN, instead of being refused here
    ("model.init_std=-0.02", "model.init_std = -0.02 must be positive"),
    ("model.norm_eps=-1e-6", "model.norm_eps = -1e-06 must be positive"),
    ("model.rope_theta=0", "model.rope_theta = 0.0 must be positive"),
    ("optimizer.eps=-1e-8", "optimizer.eps = -1e-08 must be positive"),
    ("optimizer.eps=nan", "optimizer.eps = nan must be a finite number"),
    ("optimizer.lr=inf", "optimizer.lr = inf must be a finite number"),
    ("data.sources=[{source=\"a\", weight=inf}]", "data.sources[0].weight = inf must be a finite number"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config("debug", [override])


def test_every_float_key_must_be_finite():
    import dataclasses
    import typing

    floats = [f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
              for f in dataclasses.fields(section.default_factory())
              if typing.get_type_hints(section.default_factory)[f.name] is float]
    assert len(floats) == 26 and "optimizer.eps" in floats and "model.rope_theta" in floats
    for key in floats:
        for value in ("inf", "-inf", "nan"):
            with pytest.raises(ConfigError, match=rf"^--set: {key} = {value} must be a finite number"):
                load_config("debug", [f"{key}={value}"])


@pytest.mark.parametrize("overrides, message", [
    (["distributed.nproc=2", "hardware.device=\"cuda:1\""], "names one GPU, but distributed.nproc = 2"),
    (["distributed.nproc=2", "training.auto_micro_batch=true"], "training.auto_micro_batch = true needs a single"),
    (["distributed.nnodes=2", "training.auto_micro_batch=true"], "needs a single process"),
])
def test_multi_process_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("debug", overrides)


def test_a_mistake_is_blamed_on_the_set_that_made_it():
    # the message is about n_kv_head, which the preset set; n_head, which it names too, came from --set
    with pytest.raises(ConfigError, match=r"^--set: model.n_kv_head = 2 must divide model.n_head = 3"):
        load_config("debug", ["model.n_head=3"])


def test_an_unset_context_is_the_trained_sequence_length():
    # Sampling and export use the model's context: wider than training, it would reach rotary
    # positions no step ever trained.
    cfg, _ = load_config("debug", ["model.max_seq_len=0", "training.seq_len=96"])
    assert cfg.max_seq_len == 96
    assert Config().max_seq_len == Config().training.seq_len
    assert load_config("debug", ["model.max_seq_len=128", "training.seq_len=96"])[0].max_seq_len == 128


def test_tokens_per_step_counts_every_process_on_every_machine():
    cfg, _ = load_config("debug", ["distributed.nproc=4", "distributed.nnodes=2", "training.grad_accum_steps=3"])
    t = cfg.training
    assert cfg.world == 8 and cfg.tokens_per_step == t.micro_batch_size * 3 * t.seq_len * 8


def test_range_errors_blame_set_when_the_value_came_from_there(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set: training.max_steps = -5"):
        load_config("debug", ["training.max_steps=-5"])
    p = write(tmp_path, "[training]\nmax_steps = -5\n")
    with pytest.raises(ConfigError, match=rf"^{p}: training.max_steps = -5"):
        load_config(str(p))


def test_missing_preset_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"preset 'cpuu' not found.*did you mean cpu"):
        load_config("cpuu")


def test_resolved_config_round_trips(tmp_path):
    from lmcockpit.core.run.folder import write_config

    cfg, _ = load_config("debug", ["training.max_steps=9", "sample.prompts=[\"x\"]"])
    write_config(cfg, tmp_path / "config.toml")
    again, _ = load_config(str(tmp_path / "config.toml"))
    assert again == cfg and again.hash() == cfg.hash()


def test_derived_sizes():
    cfg, _ = load_config("debug", ["model.d_model=96", "model.n_head=4"])
    assert cfg.head_dim == 24
    assert cfg.mlp_hidden == 256  # 8/3 · 96 = 256, already a multiple of 64
    assert cfg.tokens_per_step == cfg.training.micro_batch_size * cfg.training.seq_len


@pytest.mark.slow
def test_cuda_graph_modes_are_refused_with_several_processes(tmp_path):
    """DDP and FSDP accumulate gradients that the next graph replay would overwrite; `--nproc 1`
    goes through torchrun too, which only the command line shows."""
    with pytest.raises(ConfigError, match=r"compile_mode = 'reduce-overhead' uses CUDA graphs, which lmcockpit runs "
                                          r"in one process only.*distributed.nproc = 2"):
        load_config("debug", ["training.compile=true", "training.compile_mode=\"reduce-overhead\"",
                              "distributed.nproc=2"])
    load_config("debug", ["training.compile=true", "training.compile_mode=\"max-autotune-no-cudagraphs\"",
                          "distributed.nproc=2"])
    proc = cli("--run", "debug", "--nproc", "1", "--set", "training.compile=true", "--set",
               "training.compile_mode=\"max-autotune\"", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "'max-autotune' uses CUDA graphs" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("item, told", [
    ("trainng.max_steps=1", "unknown section [trainng] (did you mean training?)"),
    ("nosuch.x=1", "unknown section [nosuch] (sections: model, data, tokenizer, training, optimizer,"),
])
def test_a_set_section_that_does_not_exist_blames_the_set_item_not_the_preset(tmp_path, item, told):
    """The preset holds no such section: the `--set` item does, and the message says so, with the
    section meant, as an unknown key's does."""
    proc = cli("--run", "cpu", "--set", item, "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --set '{item}': {told}"), proc.stderr
    assert "presets" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_readme_data_source_example_works_on_the_default_preset(tmp_path):
    """The README's `--set data.source=...` example, on the `cpu` preset: without `eval.tasks=[]`
    the run is refused (its python-functions task is made from the standard library) by a message
    that gives the fix; with it, the config is whole, tasks checked."""
    import re
    import shlex

    from lmcockpit.core.tasks import catalog

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r"`--set training\.max_steps=200((?: --set \S+)+)`", readme.replace("\n", " "))
    assert example, "the README's --set example"
    sets = [word for word in shlex.split(example.group(1)) if word != "--set"]  # as the shell passes them
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 100)
    sets = ["training.max_steps=200", *(s.replace("./my_corpus", str(corpus)) for s in sets)]
    assert "eval.tasks=[]" in sets
    cfg, _ = load_config("cpu", sets)
    catalog.check(cfg)
    assert cfg.data.source == str(corpus) and cfg.eval.tasks == []

    without = [s for s in sets if s != "eval.tasks=[]"]
    proc = cli("--run", "cpu", *[a for s in without for a in ("--set", s)], "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "eval.tasks: python-functions is made from the held-out files" in lines[0]
    assert lines[0].endswith("--set 'eval.tasks=[]' scores no task)"), proc.stderr


# ---------------------------------------------------------------------------- the keys' declarations
def every_field():
    """(section.key, field) of every section's fields and of a mixture part's."""
    import dataclasses

    from lmcockpit.core.config import SECTIONS, SourcePart

    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f
    for f in dataclasses.fields(SourcePart):
        yield f"data.sources[].{f.name}", f


def test_every_key_is_declared_with_a_line_of_help():
    from lmcockpit.core.config_keys import rules_of

    for key, f in every_field():
        assert rules_of(f).help.strip(), f"{key} has no help: declare it with setting(default, help, ...)"
        assert "\n" not in rules_of(f).help, key


def test_help_config_lists_every_key_with_its_default_in_80_columns(capsys):
    """`lmcockpit help config`, through the CLI's main: each key's line names its type and its
    default (as --set writes it), and its help follows; nothing is wider than 80 columns."""
    from lmcockpit.core.config import toml_value
    from lmcockpit.core.config_keys import default_of, rules_of
    from lmcockpit.tui.cli import main

    assert main(["help", "config"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and max(map(len, out.splitlines())) <= 80
    lines = out.splitlines()
    for key, f in every_field():
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{key}  ")]
        head = lines[at]
        while lines[at + 1].startswith(" " * 8):  # a long type wraps under its key
            at += 1
            head += " " + lines[at].strip()
        if key != "data.sources":  # a list of tables: its parts' keys follow with theirs
            assert f"default {toml_value(default_of(f))}" in head, (key, head)
        assert lines[at + 1].startswith("    ") and lines[at + 1].strip() in rules_of(f).help, key
    assert 'training.on_spike  "warn" | "skip" | "rollback" | "stop", default "warn", may\n        change on resume' in out
    assert "model.n_layer  int > 0, default 4\n" in out and "optimizer.beta1  float in [0, 1), default 0.9\n" in out


def test_choices_are_read_from_the_key_that_declares_them():
    from lmcockpit.core.config import choices_of

    assert choices_of("training.on_spike") == ("warn", "skip", "rollback", "stop")
    assert choices_of("distributed.strategy") == ("ddp", "fsdp") and choices_of("training.max_steps") == ()
    with pytest.raises(ConfigError, match=r"no config key training.on_spik \(did you mean training.on_spike\?\)"):
        choices_of("training.on_spik")


@pytest.mark.parametrize("key, value, expected", [
    ("training.max_steps", "0", "training.max_steps = 0 must be a positive integer"),
    ("model.init_std", "0", "model.init_std = 0.0 must be positive"),
    ("eval.every", "-1", "eval.every = -1 must be 0 or more"),
    ("training.spike_window", "1", "training.spike_window = 1 must be 2 or more (steps)"),
    ("hardware.vram_gb", "-1", "hardware.vram_gb = -1.0 must be 0 or more (GB)"),
    ("data.val_fraction", "1", "data.val_fraction = 1.0 must be in (0, 1)"),
    ("optimizer.beta2", "1", "optimizer.beta2 = 1.0 must be in [0, 1)"),
    ("optimizer.min_lr_ratio", "1.5", "optimizer.min_lr_ratio = 1.5 must be in [0, 1]"),
    ("training.spike_lr_factor", "0", "training.spike_lr_factor = 0.0 must be in (0, 1]"),
    ("training.on_spike", '"ignore"', "training.on_spike = 'ignore' is not one of 'warn' | 'skip' | 'rollback' | 'stop'"),
])
def test_a_value_out_of_its_bounds_names_the_file_the_key_the_value_and_what_was_expected(tmp_path, key, value,
                                                                                            expected):
    section, name = key.split(".")
    p = write(tmp_path, f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert str(e.value) == f"{p}: {expected}" and e.value.keys == (key,)
    with pytest.raises(ConfigError, match=rf"^--set: {re.escape(expected)}$"):
        load_config("debug", [f"{key}={value}"])


def test_every_bound_declared_is_enforced():
    """A value just past each key's declared bound is refused by --set, naming that key."""
    from lmcockpit.core.config_keys import rules_of

    bounded = 0
    for key, f in every_field():
        rules = rules_of(f)
        if "[]" in key or (rules.gt, rules.ge, rules.lt, rules.le) == (None,) * 4:
            continue
        past = (rules.gt if rules.gt is not None else rules.ge - 1 if rules.ge is not None
                else rules.lt if rules.lt is not None else rules.le + 1)
        with pytest.raises(ConfigError, match=rf"^--set: {re.escape(key)} = \S+ must be ") as e:
            load_config("debug", [f"{key}={past}"])
        assert e.value.keys == (key,)
        bounded += 1
    assert bounded >= 50


def test_a_rule_between_keys_blames_the_set_only_for_keys_it_is_about():
    # the compile mode comes from the file's defaults; the process count, from --set
    with pytest.raises(ConfigError) as e:
        load_config("debug", ["training.compile=true", "training.compile_mode=\"reduce-overhead\"",
                              "distributed.nproc=2"])
    assert e.value.where == "--set" and "distributed.nproc" in e.value.keys


def test_a_rule_between_keys_broken_by_the_file_blames_the_file(tmp_path):
    """sample.top_k comes from --set, but the broken rule is about the model's heads: the file's."""
    p = write(tmp_path, "[model]\nn_head = 4\nn_kv_head = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p), ["sample.top_k=5"])
    assert e.value.where == str(p) and str(e.value).startswith(f"{p}: model.n_kv_head = 3 must divide")

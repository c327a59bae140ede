"""The first ten minutes: gin files layered on configs/default.gin, a --help that lists every field,
a config.gin that shows the resolved model, and console commands that exist."""

import contextlib
import dataclasses
import importlib
import io
import logging
import re
import signal
import subprocess
import sys
import tomllib

import gin
import pytest

from holmes_jax import cli, configure
from holmes_jax.config import ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from holmes_jax.models import presets
from holmes_jax.planning import load_topology
from helpers import REPO


def class_defaults(cls):
    gin.clear_config()  # the classes are gin-configurable: bound values would stand in for the defaults
    return cls()


def test_a_gin_file_is_layered_on_the_default_and_bindings_on_top(tmp_path):
    first, second = tmp_path / "a.gin", tmp_path / "b.gin"
    first.write_text("TrainConfig.steps = 7\nTrainConfig.seed = 3\n")
    second.write_text("TrainConfig.steps = 9\n")
    base = configure.load_configs([])
    cfgs = configure.load_configs(["--gin_file", str(first), f"--gin_file={second}", "--gin.TrainConfig.seed=5"])
    assert cfgs.parallel == base.parallel != class_defaults(ParallelConfig)  # default.gin still applies
    assert (cfgs.train.steps, cfgs.train.seed) == (9, 5)  # later files, then bindings, win


def test_no_default_gin_starts_from_the_class_defaults(tmp_path):
    cfgs = configure.load_configs(["--no_default_gin", "--gin.TrainConfig.steps=7"])
    assert cfgs.parallel == class_defaults(ParallelConfig)
    assert cfgs.train == dataclasses.replace(class_defaults(TrainConfig), steps=7)


def test_a_missing_default_gin_is_one_error_naming_the_way_out(tmp_path, monkeypatch):
    # a wheel install (pip install ., not -e) holds no configs/: gin's FileNotFoundError traceback
    monkeypatch.setattr(configure, "DEFAULT_GIN", tmp_path / "configs" / "default.gin")
    with pytest.raises(ConfigError, match="default.gin is missing: .*pip install -e . there.*--no_default_gin"):
        configure.load_configs([])
    assert configure.load_configs(["--no_default_gin"]).model.preset  # the class defaults still run


def test_the_operative_config_holds_the_resolved_model_and_reloads_to_it(tmp_path):
    cfgs = configure.load_configs(["--gin.ModelConfig.hidden=64"])
    operative = configure.operative_config(cfgs)
    for field in dataclasses.fields(cfgs.model):
        assert f"\nModelConfig.{field.name} = {getattr(cfgs.model, field.name)!r}\n" in operative
    for field in dataclasses.fields(cfgs.model):  # every field a preset or its defaults fill in is set
        if field.default is None and field.name != "init_from":
            assert f"ModelConfig.{field.name} = None" not in operative
    with pytest.raises(ValueError, match="no value bound"):  # gin itself is left as parsed
        gin.query_parameter("ModelConfig.num_layers")
    path = tmp_path / "config.gin"
    path.write_text(operative)
    assert configure.load_configs(["--no_default_gin", "--gin_file", str(path)]) == cfgs


def test_a_model_field_gin_wraps_over_lines_reloads_from_the_operative_config(tmp_path):
    # a Hugging Face snapshot path is longer than gin's line: gin writes it on a line of its own
    # under `ModelConfig.init_from = \`, which was left behind the resolved value, unparsable
    snapshot = "/home/me/.cache/huggingface/hub/models--gpt2/snapshots/607a30d783dfa663caf39e06633721c8d4cfcd7e"
    cfgs = configure.load_configs([f"--gin.ModelConfig.init_from={snapshot}"])
    operative = configure.operative_config(cfgs)
    assert operative.count(snapshot) == 1
    path = tmp_path / "config.gin"
    path.write_text(operative)
    assert configure.load_configs(["--no_default_gin", "--gin_file", str(path)]) == cfgs


def test_help_lists_every_field_with_its_default_and_meaning(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # wide: each meaning on its setting's line
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        configure.parse_args(["--help"])
    assert e.value.code == 0
    lines = out.getvalue().splitlines()
    meanings = configure.field_meanings()
    gin.clear_config()
    gin.parse_config_file(str(configure.DEFAULT_GIN))
    for cls in configure.CLASSES:
        based = cls()
        for field in dataclasses.fields(cls):
            name = f"{cls.__name__}.{field.name}"
            assert meanings[name], f"{name} has no '# meaning' comment in holmes_jax/config.py"
            line = next(line for line in lines if line.strip().startswith(f"{name} = "))
            assert line.strip().startswith(f"{name} = {getattr(based, field.name)!r}") and meanings[name] in line
    assert "TrainConfig.steps = 300" in out.getvalue() and "the length of the run" in out.getvalue()


def test_an_unknown_argument_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="--no_default_gin"):
        configure.parse_args(["--steps=3"])


def test_every_console_command_points_at_a_callable():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"holmes-train", "holmes-plan", "holmes-launch", "holmes-profile", "holmes-report"} <= set(scripts)
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_holmes_plan_runs_the_plan_command(monkeypatch, capsys):
    from holmes_jax import scripts

    monkeypatch.setattr(sys, "argv", ["holmes-plan", "--topology", str(REPO / "configs/topologies/cpu_2x4.toml"),
                                      "--model", "tiny", "--pp", "2", "--dp", "5"])
    with pytest.raises(SystemExit) as e:
        scripts.plan()
    assert e.value.code == 2 and "dp = 5 is not allowed" in capsys.readouterr().err


@pytest.mark.parametrize("binding, field", [
    ("ParallelConfig.stage_layers=4", "ParallelConfig.stage_layers"),  # a number, not a list (was a TypeError)
    ("TrainConfig.beta1=1.0", "TrainConfig.beta1"),  # Adam's bias correction divides by 0: NaN from step 2
    ("TrainConfig.beta2=1.0", "TrainConfig.beta2"),
    ("TrainConfig.seed=18446744073709551616", "TrainConfig.seed"),  # an OverflowError at initialisation
    # the step counter is 32-bit: an OverflowError as the step compiled, after config.gin was written
    ("TrainConfig.steps=10000000000", "TrainConfig.steps"),
    ("TrainConfig.stop_after=2147483648", "TrainConfig.stop_after"),
    ("TrainConfig.warmup_steps=2147483648", "TrainConfig.warmup_steps"),
    ("DataConfig.source=5", "DataConfig.source"),
    ("DataConfig.source=''", "DataConfig.source"),  # the current folder, silently
    ("DataConfig.cache_dir=5", "DataConfig.cache_dir"),
    ("ParallelConfig.topology=5", "ParallelConfig.topology"),
    ("ParallelConfig.topology=''", "ParallelConfig.topology"),  # silently the local topology
    ("ModelConfig.preset=['tiny']", "ModelConfig.preset"),
    # gin reads 1e999 as inf: every loss nan (the binding's inf was a gin parse error about quoting)
    ("TrainConfig.learning_rate=1e999", "TrainConfig.learning_rate"),
    ("TrainConfig.grad_clip=1e999", "TrainConfig.grad_clip"),
    ("TrainConfig.grad_clip=-1e999", "TrainConfig.grad_clip"),
    ("ModelConfig.norm_eps=1e999", "ModelConfig.norm_eps"),
    ("ModelConfig.rope_base=1e999", "ModelConfig.rope_base"),
    # True and False are not the numbers 1 and 0
    ("TrainConfig.learning_rate=True", "TrainConfig.learning_rate"),
    ("TrainConfig.warmup_steps=True", "TrainConfig.warmup_steps"),
    ("TrainConfig.min_lr_ratio=True", "TrainConfig.min_lr_ratio"),
    ("TrainConfig.weight_decay=False", "TrainConfig.weight_decay"),
    ("TrainConfig.beta1=False", "TrainConfig.beta1"),
    ("ParallelConfig.grad_reduce_dtype=[1]", "ParallelConfig.grad_reduce_dtype"),  # was a TypeError (unhashable)
    ("CheckpointConfig.enabled=1", "CheckpointConfig.enabled"),  # 1 and 0 passed as True and False
    ("ParallelConfig.zero1=0", "ParallelConfig.zero1"),
])
def test_values_that_failed_later_or_silently_are_config_errors_naming_the_field(binding, field):
    with pytest.raises(ConfigError, match=f"^{field} = .* allowed|^{field} = .* must|^{field} = .* not known"):
        configure.load_configs(["--gin.ParallelConfig.pp=1", f"--gin.{binding}"])


@pytest.mark.parametrize("binding, field, quoted", [
    ("DataConfig.source=123", "DataConfig.source", "--gin.DataConfig.source=\"'123'\""),
    ("TrainConfig.workdir=5", "TrainConfig.workdir", "--gin.TrainConfig.workdir=\"'5'\""),
    ("DataConfig.cache_dir=1.50", "DataConfig.cache_dir", "--gin.DataConfig.cache_dir=\"'1.50'\""),  # as typed
])
def test_a_number_for_a_text_field_says_how_to_quote_it(binding, field, quoted):
    with pytest.raises(ConfigError) as e:
        configure.load_configs([f"--gin.{binding}"])
    assert str(e.value).startswith(f"{field} = ") and quoted in str(e.value)


def test_a_quoted_number_is_text_and_a_number_field_takes_numbers():
    # the shell turns --gin.TrainConfig.workdir="'5'" into this argument
    cfgs = configure.load_configs(["--gin.TrainConfig.workdir='5'", "--gin.TrainConfig.steps=5"])
    assert cfgs.train.workdir == "5" and cfgs.train.steps == 5


def test_an_odd_rotary_head_size_names_the_fields():
    with pytest.raises(ConfigError, match=r"^ModelConfig.hidden = 120 / ModelConfig.num_heads = 8 = 15 must be even"):
        configure.load_configs(["--gin.ModelConfig.positions='rotary'", "--gin.ModelConfig.hidden=120",
                                "--gin.ModelConfig.num_heads=8"])


@pytest.mark.parametrize("binding, said", [
    ("TrainConfig.stepz=3", "; did you mean 'steps'? Allowed: steps, stop_after,"),
    ("TrainConfi.steps=3", "; did you mean 'TrainConfig'? Allowed: ModelConfig, ParallelConfig,"),
    ("Foo.bar=1", "; allowed: ModelConfig, ParallelConfig, DataConfig, TrainConfig, CheckpointConfig"),
])
def test_an_unknown_name_says_which_names_exist(binding, said):
    with pytest.raises(ConfigError) as e:  # gin's own message named only what was typed
        configure.load_configs([f"--gin.{binding}"])
    assert str(e.value).startswith("gin: ") and said in str(e.value)


def test_a_gin_file_that_is_missing_or_a_folder_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=r"^--gin_file '.*nope.gin': no such file$"):
        configure.load_configs(["--gin_file", str(tmp_path / "nope.gin")])
    with pytest.raises(ConfigError, match=r"^--gin_file '.*': a folder, not a gin file$"):
        configure.load_configs(["--gin_file", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^--gin_file '/dev/null': not a file$"):  # was "no such file"
        configure.load_configs(["--gin_file", "/dev/null"])


def test_paths_a_shell_leaves_with_a_tilde_start_in_the_home_folder(tmp_path, monkeypatch):
    # bash expands no '~' after '=' (--gin_file=~/x.gin) nor in a gin file: both were "no such file"
    monkeypatch.setenv("HOME", str(tmp_path))
    topology = (REPO / "configs" / "topologies" / "cpu_2x4.toml").read_text()
    (tmp_path / "t.toml").write_text(topology)
    (tmp_path / "run.gin").write_text("ParallelConfig.topology = '~/t.toml'\nTrainConfig.seed = 5\n")
    cfgs = configure.load_configs(["--gin_file=~/run.gin"])
    assert cfgs.train.seed == 5 and load_topology(cfgs.parallel.topology).num_devices == 8


def test_a_bare_word_in_a_gin_file_names_the_file_line_and_the_fix(tmp_path):
    path = tmp_path / "run.gin"
    path.write_text("TrainConfig.steps = 3\nTrainConfig.workdir = runs/x\n")
    with pytest.raises(ConfigError) as e:
        configure.load_configs(["--gin_file", str(path)])
    message = str(e.value)
    assert f"{path}, line 2" in message and "TrainConfig.workdir = runs/x" in message and "quote strings" in message
    assert "ast." not in message  # gin's own text held the repr of an ast node


@pytest.mark.parametrize("field", ["learning_rate", "grad_clip"])
@pytest.mark.parametrize("value", [1e-46, 1e39])
def test_a_rate_past_float32s_range_is_refused(field, value):
    # the step computes in float32: a learning rate of 1e-46 trained at 0, 1e39 skipped every step
    with pytest.raises(ConfigError, match=rf"^TrainConfig.{field} = {re.escape(repr(value))} must be .* in float32's range"):
        TrainConfig(**{field: value}).validate()
    TrainConfig(**{field: 1e-30}).validate()


def test_a_gin_file_with_inf_or_nan_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "run.gin"
    path.write_text("TrainConfig.learning_rate = 1e999\n")  # a file's number is gin's own: inf
    with pytest.raises(ConfigError, match=r"^TrainConfig.learning_rate = inf must be a finite positive number"):
        configure.load_configs(["--gin_file", str(path)])
    gin.clear_config()  # the file's binding would stand in for the fields not given below
    nan = float("nan")  # no gin literal: the Python API
    for config, field in ((TrainConfig(learning_rate=nan), "TrainConfig.learning_rate"),
                          (TrainConfig(grad_clip=nan), "TrainConfig.grad_clip"),
                          (DataConfig(val_fraction=nan), "DataConfig.val_fraction")):
        with pytest.raises(ConfigError, match=f"^{field} = nan"):
            config.validate()
    with pytest.raises(ConfigError, match="^ModelConfig.norm_eps = nan"):
        presets.resolve(ModelConfig(norm_eps=nan))


def test_a_binding_that_builds_no_value_is_one_error_line_naming_it(capsys):
    from holmes_jax import train

    with pytest.raises(SystemExit) as e:  # was an uncaught TypeError (unhashable type: 'list')
        cli.run(train.main, ["--gin.TrainConfig.steps={[1]: 2}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --gin.TrainConfig.steps={[1]: 2}: ") and err.count("\n") == 1


@pytest.mark.parametrize("value", ["'/tmp/x", "/tmp/x'", '"runs/x', "'"])
def test_a_bare_word_with_a_quote_left_open_is_refused(value):
    # taken as the word itself: the run wrote into a folder named "'" under the current folder
    with pytest.raises(ConfigError, match=r"a quote is not closed"):
        configure.load_configs([f"--gin.TrainConfig.workdir={value}"])
    assert configure.load_configs(["--gin.TrainConfig.workdir=runs/bob's"]).train.workdir == "runs/bob's"


def test_a_preset_named_over_a_runs_config_gin_is_refused_where_it_would_keep_the_old_shape(tmp_path):
    # the run's config.gin writes out every field of its preset: a new preset on top of it changed
    # only the name, and trained 'tiny' (learned positions, gelu) as 'llama-tiny'
    saved = tmp_path / "config.gin"
    saved.write_text(configure.operative_config(configure.load_configs([])))
    with pytest.raises(ConfigError) as e:
        configure.load_configs(["--gin_file", str(saved), "--gin.ModelConfig.preset=llama-tiny"])
    assert str(e.value).startswith(f"ModelConfig.preset = 'llama-tiny' (a --gin flag) is set over --gin_file {saved}, "
                                   "which writes out the fields of preset 'tiny': ffn_hidden, positions, norm, mlp, "
                                   "tie_embeddings, num_kv_heads would keep their 'tiny' values"), e.value
    flags = ["--gin.ModelConfig.preset=llama-tiny", "--gin.ModelConfig.ffn_hidden=384", "--gin.ModelConfig.positions=rotary",
             "--gin.ModelConfig.norm=rmsnorm", "--gin.ModelConfig.mlp=swiglu", "--gin.ModelConfig.tie_embeddings=False",
             "--gin.ModelConfig.num_kv_heads=2"]
    assert configure.load_configs(["--gin_file", str(saved)] + flags).model == presets.resolve(
        ModelConfig(preset="llama-tiny", vocab_size=256))
    # a field set to other than its preset's value is an override; one set without a preset too
    (tmp_path / "deeper.gin").write_text("ModelConfig.preset = 'tiny'\nModelConfig.num_layers = 2\n")
    (tmp_path / "layers.gin").write_text("ModelConfig.num_layers = 4\n")
    for name in ("deeper.gin", "layers.gin"):
        model = configure.load_configs(["--gin_file", str(tmp_path / name), "--gin.ModelConfig.preset=125m"]).model
        assert (model.hidden, model.num_layers) == (768, 2 if name == "deeper.gin" else 4)


def test_a_gin_file_includes_the_files_beside_it_from_any_folder(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "base.gin").write_text("TrainConfig.steps = 7\n")
    (folder / "run.gin").write_text("include 'base.gin'\nTrainConfig.seed = 3\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # includes were found from the current folder only
    with caplog.at_level(logging.INFO):
        cfgs = configure.load_configs(["--gin_file", str(folder / "run.gin")])
    assert (cfgs.train.steps, cfgs.train.seed) == (7, 3)
    # gin logs "Path not found" for each folder an include is not in, even one found later
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_include_found_nowhere_is_one_config_error_without_a_log_line(tmp_path, caplog):
    path = tmp_path / "run.gin"
    path.write_text("include 'missing.gin'\n")
    with caplog.at_level(logging.INFO), pytest.raises(ConfigError, match="missing.gin"):
        configure.load_configs(["--gin_file", str(path)])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # was ERROR:root:Path not found


def test_a_binding_without_a_class_is_refused_unless_a_gin_file_uses_it(tmp_path):
    # gin read `--gin.steps=3` as a macro nothing used: the run went on with 300 steps
    with pytest.raises(ConfigError, match=r"^--gin.steps=3 sets nothing: .* TrainConfig.steps"):
        configure.load_configs(["--gin.steps=3"])
    with pytest.raises(ConfigError, match="ModelConfig.vocab_size or DataConfig.vocab_size"):
        configure.load_configs(["--gin.vocab_size=512"])
    path = tmp_path / "run.gin"
    path.write_text("TrainConfig.steps = %STEPS\n")  # a macro a gin file uses is what macros are for
    assert configure.load_configs(["--gin_file", str(path), "--gin.STEPS=7"]).train.steps == 7
    with pytest.raises(ConfigError) as e:  # an unbound macro: gin's message went on with the whole config
        configure.load_configs(["--gin_file", str(path)])
    assert str(e.value) == ("gin: No bindings specified for 'STEPS/gin.macro': %STEPS is used, and no gin file nor "
                            "--gin flag sets it; allowed: STEPS = VALUE in a gin file, or --gin.STEPS=VALUE")


def test_a_killed_commands_temporary_output_is_removed_by_the_next(tmp_path):
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", "import os, signal, sys\nfrom holmes_jax import cli\n"
                             "with cli.output_folder(sys.argv[1], 'meta') as tmp:\n"
                             "    (tmp / 'part').write_text('x')\n    os.kill(os.getpid(), signal.SIGKILL)", str(out)],
                            cwd=REPO)
    assert killed.returncode == -signal.SIGKILL and [p.name for p in tmp_path.iterdir()] != []
    with cli.output_folder(out, "meta") as tmp:
        (tmp / "meta").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the killed one's folder stayed forever
    assert [p.name for p in out.iterdir()] == ["meta"]


def test_an_unknown_flag_is_one_line_naming_the_flags_there_are():
    parser = cli.Parser()
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int)
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: --bogus; allowed: --help, --out, --steps$"):
        parser.parse_args(["--bogus"])


def help_lines(monkeypatch, columns: int) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        configure.parse_args(["--help"])
    return out.getvalue().splitlines()


def test_help_fits_an_80_column_terminal_and_keeps_every_meaning(monkeypatch):
    lines = help_lines(monkeypatch, 80)  # lines ran to 180 characters: the terminal broke them anywhere
    assert max(map(len, lines)) <= 80
    text = " ".join(" ".join(lines).split())
    for name, meaning in configure.field_meanings().items():
        assert f"{name} = " in text and " ".join(meaning.split()) in text, name
    assert max(map(len, help_lines(monkeypatch, 130))) <= 130


def test_help_gives_the_presets_value_of_a_model_field_left_none(monkeypatch):
    text = "\n".join(help_lines(monkeypatch, 200))
    tiny = presets.resolve(class_defaults(ModelConfig))  # configs/default.gin names the preset 'tiny'
    assert f"ModelConfig.num_layers = None (preset 'tiny': {tiny.num_layers})" in text  # was only 'None'
    assert f"ModelConfig.hidden = None (preset 'tiny': {tiny.hidden})" in text


@pytest.mark.parametrize("argv", [
    ["--gin.TrainConfig.workdir", "--gin.TrainConfig.steps=2"],  # workdir became '--gin.TrainConfig.steps=2'
    ["--gin_file", "--gin.TrainConfig.steps=2"],
])
def test_a_flag_missing_its_value_does_not_take_the_next_flag_as_it(argv):
    with pytest.raises(ConfigError, match=f"^{argv[0]} needs a"):
        configure.load_configs(argv)
    assert configure.load_configs(["--gin.TrainConfig.seed", "3"]).train.seed == 3  # a value still may follow


@pytest.mark.parametrize("arg", ["--gin.", "--gin.=3"])
def test_a_binding_without_a_name_says_how_one_is_written(arg):
    # '--gin.' said: needs a value: --gin.=VALUE; '--gin.=3' was gin's "Unexpected token"
    with pytest.raises(ConfigError, match=r"names no field; allowed: --gin.Class.field=VALUE"):
        configure.load_configs([arg])


def test_a_scoped_binding_is_refused_naming_the_field_it_meant(tmp_path):
    # gin keeps `scope/Class.field` for classes built in that scope; ours never are: the run used 300 steps
    with pytest.raises(ConfigError, match=r"^gin: train/TrainConfig.steps sets nothing: .* allowed: TrainConfig.steps"):
        configure.load_configs(["--gin.train/TrainConfig.steps=3"])
    path = tmp_path / "run.gin"
    path.write_text("a/b/ModelConfig.hidden = 64\n")
    with pytest.raises(ConfigError, match=r"^gin: a/b/ModelConfig.hidden sets nothing"):
        configure.load_configs(["--gin_file", str(path)])
    # a slash for the dot: a macro in scope TrainConfig, and the run went on with 300 steps
    with pytest.raises(ConfigError, match=r"^gin: TrainConfig/steps sets nothing: it is a gin macro in scope "
                                          r"'TrainConfig'; a field is named Class.field, as in TrainConfig.steps$"):
        configure.load_configs(["--gin.TrainConfig/steps=2"])


def test_a_gin_file_tokenize_or_utf8_cannot_read_names_the_file_and_line(tmp_path):
    # gin's message was ('EOF in multi-line statement', (3, 0)), or the codec's, with no file
    unclosed, binary, including = tmp_path / "unclosed.gin", tmp_path / "binary.gin", tmp_path / "run.gin"
    unclosed.write_text("TrainConfig.steps = 3\nParallelConfig.stage_layers = (2,\n")
    binary.write_bytes(b"\xff\xfe TrainConfig.steps = 3\n")
    including.write_text("TrainConfig.seed = 1\ninclude 'unclosed.gin'\n")
    with pytest.raises(ConfigError, match=rf"^gin: {unclosed}, line 3: EOF in multi-line statement: a bracket"):
        configure.load_configs(["--gin_file", str(unclosed)])
    with pytest.raises(ConfigError, match=rf"^gin: {binary}: not UTF-8 text"):
        configure.load_configs(["--gin_file", str(binary)])
    with pytest.raises(ConfigError) as e:  # the included file is named, and where it is included
        configure.load_configs(["--gin_file", str(including)])
    message = str(e.value)
    assert re.match(r"gin: \S*unclosed.gin, line 3: EOF", message) and f'In file "{including}", line 2' in message


def test_a_changed_macro_is_a_changed_setting_on_resume():
    saved = "# Macros:\nSTEPS = 7\n\n# Parameters for TrainConfig:\nTrainConfig.steps = %STEPS\n"
    # `TrainConfig.steps = %STEPS` reads the same in both: the longer run went unmentioned
    assert configure.changed_settings(saved, saved.replace("STEPS = 7", "STEPS = 9")) == ["STEPS 7 -> 9"]


def test_the_workdir_spelt_otherwise_is_no_changed_setting_on_resume():
    saved = "TrainConfig.workdir = '/tmp/runs/a'\nTrainConfig.steps = 7\n"
    resumed = "TrainConfig.workdir = '/tmp/runs/a/'\nTrainConfig.steps = 9\n"  # was listed as a change
    assert configure.changed_settings(saved, resumed) == ["TrainConfig.steps 7 -> 9"]


def test_gin_files_that_include_each_other_are_one_short_error_line(tmp_path):
    # gin recursed to Python's limit: its message named the include a thousand times over
    first, second, alone = tmp_path / "a.gin", tmp_path / "b.gin", tmp_path / "self.gin"
    first.write_text("TrainConfig.seed = 1\ninclude 'b.gin'\n")
    second.write_text("include 'a.gin'\n")
    alone.write_text("include 'self.gin'\n")
    with pytest.raises(ConfigError) as e:
        configure.load_configs(["--gin_file", str(first)])
    assert str(e.value).startswith(f"gin: {first} includes 'b.gin', which includes 'a.gin': an include cycle")
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=rf"^gin: {alone} includes 'self.gin': an include cycle"):
        configure.load_configs(["--gin_file", str(alone)])


def test_a_gin_files_binding_without_a_class_is_refused_unless_something_uses_it(tmp_path):
    # `steps = 3` in a file is a gin macro nothing used: the run went on with 300 steps, silently
    path = tmp_path / "run.gin"
    path.write_text("TrainConfig.seed = 1\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"^gin: steps = 3 in a gin file sets nothing: .* TrainConfig.steps"):
        configure.load_configs(["--gin_file", str(path)])
    path.write_text("STEPS = 7\nTrainConfig.steps = %STEPS\n")  # a macro used is what macros are for
    assert configure.load_configs(["--gin_file", str(path)]).train.steps == 7


def test_each_gin_files_include_is_the_file_beside_it_not_one_beside_another(tmp_path):
    for name, line in (("first", "TrainConfig.seed = 1"), ("second", "TrainConfig.steps = 9")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "base.gin").write_text(line + "\n")
        (tmp_path / name / "run.gin").write_text("include 'base.gin'\n")
    # both includes read first/base.gin: the second file's base.gin was never read, silently
    cfgs = configure.load_configs(["--gin_file", str(tmp_path / "first" / "run.gin"),
                                   "--gin_file", str(tmp_path / "second" / "run.gin")])
    assert (cfgs.train.seed, cfgs.train.steps) == (1, 9)


def test_an_include_is_the_file_beside_its_includer_wherever_the_run_starts(tmp_path, monkeypatch):
    # gin looked in the current folder first: started in first/, second/run.gin read first/base.gin;
    # and a file included from a subfolder could not include the files beside it
    for name, line in (("first", "TrainConfig.seed = 1"), ("second", "TrainConfig.seed = 2")):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "base.gin").write_text(line + "\n")
        (tmp_path / name / "run.gin").write_text("include 'base.gin'\ninclude 'sub/nested.gin'\n")
        (tmp_path / name / "sub" / "nested.gin").write_text("include 'steps.gin'\n")
        (tmp_path / name / "sub" / "steps.gin").write_text(f"TrainConfig.steps = {len(name)}\n")
    (tmp_path / "first" / "steps.gin").write_text("TrainConfig.steps = 99\n")  # not beside nested.gin
    monkeypatch.chdir(tmp_path / "first")
    cfgs = configure.load_configs(["--gin_file", "../second/run.gin"])
    assert (cfgs.train.seed, cfgs.train.steps) == (2, 6)
    assert configure.load_configs(["--gin_file", "run.gin"]).train.steps == 5


def test_a_gin_file_saved_with_a_byte_order_mark_sets_its_values(tmp_path):
    # Windows editors start a UTF-8 file with a byte-order mark: gin refused its first line
    # ('Unexpected token'), and read the mark of an included file the same way
    bom = "\ufeff"
    (tmp_path / "base.gin").write_text(bom + "TrainConfig.steps = 9\n", encoding="utf-8")
    (tmp_path / "run.gin").write_text(bom + "TrainConfig.seed = 7\ninclude 'base.gin'\n", encoding="utf-8")
    cfgs = configure.load_configs(["--gin_file", str(tmp_path / "run.gin")])
    assert (cfgs.train.seed, cfgs.train.steps) == (7, 9)
    assert gin.config._FILE_READERS[0][0] is open  # gin's own reader is back for whoever parses next


def test_a_field_added_since_the_saved_config_is_a_change_only_off_its_default():
    # A checkpoint of a version without TrainConfig.lr_schedule: resuming it said the schedule
    # changed from (unset) to 'cosine', the default it had all along.
    saved = configure.operative_config(configure.load_configs([]))
    older = "\n".join(line for line in saved.splitlines() if not line.startswith("TrainConfig.lr_schedule"))
    assert older != saved
    assert configure.changed_settings(older, saved) == []
    wsd = saved.replace("TrainConfig.lr_schedule = 'cosine'", "TrainConfig.lr_schedule = 'wsd'")
    assert configure.changed_settings(older, wsd) == ["TrainConfig.lr_schedule (unset) -> 'wsd'"]
    assert configure.changed_settings(saved, older) == ["TrainConfig.lr_schedule 'cosine' -> (unset)"]


def test_the_train_config_of_a_saved_config_reads_values_gin_wrapped_and_refuses_macros():
    workdir = "/tmp/" + "a-long-folder-name/" * 6 + "run"  # gin writes `= \` and the value on the next line
    saved = configure.operative_config(configure.load_configs(
        [f"--gin.TrainConfig.workdir={workdir}", "--gin.TrainConfig.lr_schedule='wsd'"]))
    assert "TrainConfig.workdir = \\\n" in saved
    found = configure.train_config_of(saved)
    assert found.workdir == workdir and found.lr_schedule == "wsd" and found.steps == TrainConfig().steps
    assert configure.train_config_of(saved.replace("TrainConfig.steps = 300", "TrainConfig.steps = %STEPS")) is None


def test_a_workdir_under_the_home_folder_is_expanded(monkeypatch, tmp_path):
    # a gin file's '~/runs/x' (no shell expands it) made a folder named '~' in the working folder
    monkeypatch.setenv("HOME", str(tmp_path))
    cfgs = configure.load_configs(["--gin.TrainConfig.workdir='~/runs/x'"])
    assert cfgs.train.workdir == str(tmp_path / "runs" / "x")

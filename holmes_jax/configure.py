"""A run's configs from the command line: gin files and `--gin.NAME=VALUE` bindings, parsed into
the typed dataclasses of holmes_jax.config and validated (the model resolved from its preset)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import io
import logging
import math
import os
import re
import shutil
import textwrap
import tokenize
import typing
from pathlib import Path

import gin

from holmes_jax import config, data
from holmes_jax.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from holmes_jax.models import presets

DEFAULT_GIN = Path(__file__).resolve().parent.parent / "configs" / "default.gin"
CLASSES = (ModelConfig, ParallelConfig, DataConfig, TrainConfig, CheckpointConfig)
USAGE = """usage: python -m holmes_jax.train [--gin_file FILE ...] [--gin.NAME=VALUE ...]
                                  [--no_default_gin]

Trains a GPT. configs/default.gin is read first; each --gin_file is layered on
top of it, in order, then each --gin.NAME=VALUE binding, wherever it stands on
the command line: a field set twice keeps the last value. --no_default_gin skips
configs/default.gin, so fields not set start from the defaults of the classes
(the "class default" below). The run writes WORKDIR/config.gin: every field as
it was used, the model's preset filled in; `--gin_file WORKDIR/config.gin`
reruns (or resumes) that run."""


@dataclasses.dataclass(frozen=True)
class Configs:
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    train: TrainConfig
    checkpoint: CheckpointConfig


class _QuietGinLookups(logging.Filter):
    """Drops gin's `ERROR:root:Path not found: x.gin`: its package-resource reader logs one for each
    folder of the search path that an include is not in, even when a later folder has it. An include
    found nowhere is raised, and reported as one `error:` line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.endswith(os.path.join("gin", "resource_reader.py"))


logging.getLogger().addFilter(_QuietGinLookups())  # gin logs with logging.error, on the root logger


def _text_fields() -> set[str]:
    """'Class.field' of every field that holds text (`str` or `str | None`)."""
    return {f"{cls.__name__}.{name}" for cls in CLASSES for name, kind in typing.get_type_hints(cls).items()
            if kind in (str, str | None)}


def _gin_value(name: str, text: str) -> str:
    """A gin literal for `text`; bare words (paths, 'gpipe') become strings so users need no quotes."""
    if text.startswith(("@", "%")):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if text[:1] in ("'", '"') or text[-1:] in ("'", '"'):  # a quote not closed: a typo, not a name
            raise ConfigError(f"--gin.{name}={text}: a quote is not closed; allowed: a Python literal, as in "
                              f"--gin.{name}=\"'runs/x'\" (the shell drops the outer quotes), or a bare word") from None
        return repr(text)
    except TypeError as e:  # a literal that builds no value, as {[1]: 2} (a list as a key)
        raise ConfigError(f"--gin.{name}={text}: not a value ({e}); allowed: a Python literal, "
                          f"as in 3, 0.1, 'runs/x' or (2, 2)") from None
    # A number is a number, as in gin (the bare-word rule covers words only): for a text field say
    # how to quote it, where the field's own check said only that the number is not allowed.
    field = ".".join(name.rpartition("/")[2].split(".")[-2:])
    if isinstance(value, (int, float)) and not isinstance(value, bool) and field in _text_fields():
        raise ConfigError(f"{field} = {text} is a number, and {field} holds text; allowed: text, quoted where it "
                          f"could be read as a number, as in --gin.{name}=\"'{text}'\" (the shell drops the outer quotes)")
    # repr(inf) is a word gin cannot parse; from the text (1e999) gin reads inf, which validate() refuses
    return text if isinstance(value, float) and not math.isfinite(value) else repr(value)


@contextlib.contextmanager
def _open_gin_file(path: str):
    """A gin file's text, for gin to parse, with
    - its `include 'x.gin'` looked up beside it, and only there: gin looks an include up in each
      folder of its search path, whose first is the current folder (a same-named file there won
      over the one beside), and whose folders `add_config_file_search_path` adds for the rest of
      the process (two --gin_files from two folders read the first one's 'base.gin' both);
    - the byte-order mark Windows editors write at its start dropped: read with plain `open`,
      gin's tokenizer refused the file's first line ('Unexpected token')."""
    search_path = gin.config._LOCATION_PREFIXES  # gin has no public way to set it
    saved = list(search_path)
    search_path[:] = [str(Path(path).resolve().parent)]
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield f
    finally:
        search_path[:] = saved


@contextlib.contextmanager
def _gin_reads_our_way():
    """gin opens each file, an include too, with the first of its readers whose check passes, and
    its first is plain `open` (a file on disk): `_open_gin_file` stands in for it while we parse."""
    readers = gin.config._FILE_READERS  # gin has no public way to replace a reader
    saved = list(readers)
    readers[:] = [(_open_gin_file if reader is open else reader, exists) for reader, exists in saved]
    try:
        yield
    finally:
        readers[:] = saved


def _a_value_follows(args: list[str]) -> bool:
    return bool(args) and not args[0].startswith("--")


def parse_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits argv into gin files and gin bindings ('Class.field = value')."""
    files, bindings = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(USAGE + "\n\n" + fields_help())
            raise SystemExit(0)
        if arg == "--no_default_gin":
            files.append(None)  # a marker: load_configs leaves the base file out
            continue
        if arg == "--gin_file" or arg.startswith("--gin_file="):
            # the next argument, unless it is the next flag (`--gin_file --gin.X=1` forgot the file)
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if _a_value_follows(args) else None)
            if not value:
                raise ConfigError("--gin_file needs a file name; allowed: --gin_file FILE or --gin_file=FILE")
            files.append(value)
        elif arg.startswith("--gin."):
            name, eq, value = arg[len("--gin."):].partition("=")
            if not name.strip():
                raise ConfigError(f"{arg!r} names no field; allowed: --gin.Class.field=VALUE, as in "
                                  f"--gin.TrainConfig.steps=100")
            if not eq:  # `--gin.X VALUE`; `--gin.X --gin.Y=1` set X to the text of the next flag
                if not _a_value_follows(args):
                    raise ConfigError(f"--gin.{name} needs a value: --gin.{name}=VALUE")
                value = args.pop(0)
            bindings.append(f"{name} = {_gin_value(name, value)}")
        else:
            raise ConfigError(f"unknown argument {arg!r}; allowed: --gin_file FILE, --gin.NAME=VALUE, "
                              f"--no_default_gin, --help")
    return files, bindings


def _allowed_names(message: str) -> str:
    """What gin's unknown-name message leaves out: the names that exist, the nearest first."""
    by_class = {cls.__name__: [f.name for f in dataclasses.fields(cls)] for cls in CLASSES}
    if found := re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", message):
        names, typed = by_class.get(found.group(1)), found.group(2)
    elif found := re.search(r"No configurable matching '([\w.]+)'", message):
        names, typed = list(by_class), found.group(1)
    elif found := re.search(r"No bindings specified for '(\w+)/gin.macro'", message):
        return (f": %{found.group(1)} is used, and no gin file nor --gin flag sets it; allowed: {found.group(1)} = "
                f"VALUE in a gin file, or --gin.{found.group(1)}=VALUE")
    else:
        return ""
    if not names:
        return ""
    near = difflib.get_close_matches(typed, names, n=1)
    return (f"; did you mean {near[0]!r}? Allowed: " if near else "; allowed: ") + ", ".join(names)


def _check_macros(bindings: list[str]) -> None:
    """gin takes `--gin.steps=3`, or a gin file's `steps = 3` (no class), as a macro, which sets
    nothing unless a gin file uses `%steps`: a typo that was silently ignored. Call after the
    configs are built (gin's operative config then lists the macros used)."""
    used = gin.operative_config_str()
    flags = dict(binding.split(" = ", 1) for binding in bindings)
    # gin's config lists every binding, a macro's without a dot in its name
    for name, value in re.findall(r"^(\w+) = (.*)$", gin.config_str(), flags=re.MULTILINE):
        if not re.search(rf"^{name} = ", used, flags=re.MULTILINE):
            fields = [f"{cls.__name__}.{name}" for cls in CLASSES if name in {f.name for f in dataclasses.fields(cls)}]
            where = f"--gin.{name}={flags[name]}" if name in flags else f"gin: {name} = {value} in a gin file"
            raise ConfigError(f"{where} sets nothing: a field is named Class.field, as in "
                              f"{' or '.join(fields) or 'TrainConfig.steps'} (a bare name is a gin macro, "
                              f"and no gin file uses %{name})")


def _check_scopes() -> None:
    """gin keeps `scope/Class.field = v` for a class built inside that scope, and ours are built
    outside any: such a binding, in a file or a flag, set nothing, silently. So did `scope/name =
    v` (a scoped macro), which the typo `TrainConfig/steps` for `TrainConfig.steps` makes."""
    found = re.search(r"^(\S+)/(\S+) = ", gin.config_str(), flags=re.MULTILINE)
    if found and "." in found[2]:
        raise ConfigError(f"gin: {found[1]}/{found[2]} sets nothing: the configs are built outside any gin "
                          f"scope; allowed: {found[2]}, without '{found[1]}/'")
    if found:
        raise ConfigError(f"gin: {found[1]}/{found[2]} sets nothing: it is a gin macro in scope {found[1]!r}; "
                          f"a field is named Class.field, as in {found[1]}.{found[2]}")


def _parsing_file(traceback) -> str | None:
    """The gin file whose text raised: the innermost gin parser on the way (an included file's,
    not only the --gin_file's that includes it); None for a --gin binding."""
    name = None
    while traceback:
        parser = traceback.tb_frame.f_locals.get("self")
        if isinstance(parser, gin.config_parser.ConfigParser):
            name = getattr(parser, "_filename", None)
        traceback = traceback.tb_next
    return name


def _unreadable(e: Exception) -> str:
    """One line for a gin file that tokenize or UTF-8 cannot read; gin's own message was a tuple,
    as in ('EOF in multi-line statement', (3, 0)), or the codec's, without the file."""
    first, _, includes = str(e).partition("\n")  # gin appends 'In file "a.gin", line 1 include ...' per include
    where = _parsing_file(e.__traceback__) or "--gin binding"
    if found := re.fullmatch(r"\('(.*)', \((\d+), \d+\)\)", first):
        reason = (f", line {found[2]}: {found[1]}: a bracket, a triple-quoted string or a line ending in a "
                  f"backslash is never closed")
    else:
        reason = f": not UTF-8 text ({first})" if isinstance(e, UnicodeDecodeError) else f": {first}"
    return " ".join(f"gin: {where}{reason}{'; ' + includes if includes else ''}".split())


def _include_cycle(e: RecursionError) -> str:
    """One line for gin files that include themselves, or each other: gin recursed to Python's
    limit, and its message named every include on the way, a thousand lines."""
    includes = re.findall(r'In file "(.*?)", line \d+\s+include (\'.*?\'|".*?")', str(e))[::-1]  # outermost first
    if not includes:  # a recursion of another kind, as a value nested a thousand brackets deep
        return f"gin: {str(e).splitlines()[0]}"
    files = [file for file, _ in includes]
    seen = {Path(files[0]).resolve()}
    chain = f"gin: {files[0]} includes {includes[0][1]}"
    for file, (_, included) in zip(files[1:], includes[1:]):
        if Path(file).resolve() in seen:
            break
        seen.add(Path(file).resolve())
        chain += f", which includes {included}"
    return chain + ": an include cycle; allowed: includes that never lead back to a file including them"


def _default_gin() -> Path:
    """configs/default.gin of the repository the package is installed from (editable, as the
    README installs it: a wheel holds the package alone)."""
    if not DEFAULT_GIN.is_file():
        raise ConfigError(f"{DEFAULT_GIN} is missing: holmes_jax reads configs/default.gin from the repository it "
                          "was installed from (pip install -e . there), or skip it with --no_default_gin")
    return DEFAULT_GIN


def load_configs(argv: list[str]) -> Configs:
    """Parses configs/default.gin, the gin files on top of it and the bindings into validated configs
    (the model resolved from its preset)."""
    files, bindings = parse_args(argv)
    base = [] if None in files else [str(_default_gin())]
    # '~' too: bash leaves `--gin_file=~/x.gin` as it is
    files = [os.path.expanduser(f) for f in files if f is not None]
    for f in files:
        if not Path(f).is_file():
            why = "a folder, not a gin file" if Path(f).is_dir() else "not a file" if Path(f).exists() else "no such file"
            raise ConfigError(f"--gin_file {f!r}: {why}")
    gin.clear_config()
    try:
        with _gin_reads_our_way():  # gin.parse_config_files_and_bindings, each file's includes beside it
            for f in base + files:
                gin.parse_config_file(f)
        gin.parse_config(bindings)
        gin.finalize()
        cfgs = Configs(*(cls() for cls in CLASSES))
    except ConfigError:
        raise
    except RecursionError as e:
        raise ConfigError(_include_cycle(e)) from None
    except (tokenize.TokenError, UnicodeDecodeError) as e:  # gin's message named no file, nor a line
        raise ConfigError(_unreadable(e)) from None
    except SyntaxError as e:  # for a bare word gin's message starts with an ast node's repr: keep its last line
        reason = str(e.msg).splitlines()[-1].strip()
        raise ConfigError(f"gin: {e.filename or '--gin binding'}, line {e.lineno}: {(e.text or '').strip()!r}: "
                          f"{reason} (a value is a Python literal: quote strings, as in 'runs/x')") from None
    except Exception as e:  # gin reports unknown names and unparsable values with assorted types
        # an unbound %macro's message went on with the whole config text
        message = "gin: " + " ".join(str(e).partition(" in config string:")[0].split())
        raise ConfigError(message + _allowed_names(message)) from None
    _check_macros(bindings)
    _check_scopes()
    for c in (cfgs.parallel, cfgs.data, cfgs.train, cfgs.checkpoint):
        c.validate()
    # '~/runs/x' in a gin file (no shell expands it) made a folder named '~' in the working folder
    train = dataclasses.replace(cfgs.train, workdir=os.path.expanduser(cfgs.train.workdir))
    cfgs = dataclasses.replace(cfgs, train=train)
    model = cfgs.model
    if model.vocab_size is None and (declared := data.vocab_size(cfgs.data)):  # unset: follow the data's
        # not also a multiple of tp: the model (and its checkpoints) would change with the layout,
        # and a resume on tp 3 refuse one saved on tp 1; a vocabulary tp does not divide is not split
        model = dataclasses.replace(model, vocab_size=data.padded_vocab(declared))
    model = presets.resolve(model)
    _check_preset_fields(base + files, bindings, model.preset)
    return dataclasses.replace(cfgs, model=model)


def _literal(text: str | None):
    try:
        return ast.literal_eval(text) if text is not None else None
    except (ValueError, SyntaxError, TypeError):
        return None


def _check_preset_fields(files: list[str], bindings: list[str], preset: str) -> None:
    """A preset named over a gin file that sets another preset and writes out its fields (a run's
    config.gin does) left them as they were: a model of the old preset's shape under the new one's
    name. Refused, naming them; a field the file sets to other than its preset's own value is an
    override, and stays."""
    sources = [(f"--gin_file {f}", _bindings(Path(f).read_text(encoding="utf-8-sig"))) for f in files]
    sources.append(("a --gin flag", _bindings("\n".join(bindings))))
    named = [i for i, (_, bound) in enumerate(sources) if "ModelConfig.preset" in bound]
    if not named or _literal(sources[named[-1]][1]["ModelConfig.preset"]) != preset:
        return  # a preset set by an include or a macro: not followed here
    new = presets.preset_values(preset)  # not ModelConfig(preset=...): gin would fill in the bound fields
    for i in named[:-1]:
        where, bound = sources[i]
        old_name = _literal(bound["ModelConfig.preset"])
        if old_name == preset or old_name not in presets.PRESETS:
            continue
        old = presets.preset_values(old_name)
        stale = [name for name in old if f"ModelConfig.{name}" in bound
                 and not any(f"ModelConfig.{name}" in later for _, later in sources[i + 1:])
                 and _literal(bound[f"ModelConfig.{name}"]) == old[name] != new.get(name)]
        if stale:
            raise ConfigError(f"ModelConfig.preset = {preset!r} ({sources[named[-1]][0]}) is set over {where}, which "
                              f"writes out the fields of preset {old_name!r}: {', '.join(stale)} would keep their "
                              f"{old_name!r} values, a model of its shape named {preset!r}; allowed: a gin file that "
                              f"leaves them out (a run's config.gin writes them all), or each of them set as well")


def operative_config(cfgs: Configs) -> str:
    """gin's operative config with the model's fields as resolved from the preset (gin saw them
    as None), so WORKDIR/config.gin shows the model run and reloads to it. Written into the text
    rather than bound into gin, where the values would leak into every later ModelConfig()."""
    text = gin.operative_config_str()
    for field in dataclasses.fields(ModelConfig):
        line = f"ModelConfig.{field.name} = {getattr(cfgs.model, field.name)!r}"
        # the binding's indented lines too: gin wraps a long value (an init_from path) onto them
        text = re.sub(rf"^ModelConfig\.{field.name} = .*(\n[ \t].*)*$", lambda _, line=line: line, text,
                      flags=re.MULTILINE)
    return text


def _bindings(text: str) -> dict[str, str]:
    """'Class.field' -> its value as written, from a config.gin (a value gin wraps over several
    lines is joined), and each macro's 'NAME': `TrainConfig.steps = %STEPS` reads the same
    whatever STEPS is."""
    found, name = {}, None
    for line in text.splitlines():
        if m := re.match(r"^(\w+(?:\.\w+)?) = (.*)$", line):
            name, found[m[1]] = m[1], m[2].removesuffix("\\").rstrip()  # gin's `= \` before a long value
        elif name and line[:1].isspace():
            found[name] = f"{found[name]} {line.strip()}".lstrip()
        else:
            name = None
    return found


def changed_settings(old: str, new: str) -> list[str]:
    """'Class.field OLD -> NEW' for each setting that differs between two config.gin texts, but
    `TrainConfig.stop_after`, which a run ended early and resumed changes by design, and
    `TrainConfig.workdir`, the folder both texts were read from however it is spelt (`runs/x/`,
    an absolute path, a moved folder). A field only `new` has at its default is a field added
    since `old`'s version, not a change."""
    before, after = _bindings(old), _bindings(new)
    defaults = {f"{cls.__name__}.{f.name}": repr(f.default) for cls in CLASSES for f in dataclasses.fields(cls)}
    return [f"{k} {before.get(k, '(unset)')} -> {after.get(k, '(unset)')}"
            for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k) and k not in ("TrainConfig.stop_after", "TrainConfig.workdir")
            and not (k not in before and after[k] == defaults.get(k))]


def train_config_of(text: str) -> TrainConfig | None:
    """The TrainConfig a config.gin text binds (class defaults for the fields it lacks), or None
    where a TrainConfig value is not a plain literal (a macro's `%NAME`)."""
    fields, values = {f.name for f in dataclasses.fields(TrainConfig)}, {}
    for key, value in _bindings(text).items():
        cls, _, name = key.partition(".")
        if cls == "TrainConfig" and name in fields:
            try:
                values[name] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                return None
    return TrainConfig(**values)


def field_meanings() -> dict[str, str]:
    """'Class.field' -> the trailing `# comment` of its line in holmes_jax/config.py (the one place
    a field's meaning is written down)."""
    source = inspect.getsource(config)
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    return {f"{node.name}.{item.target.id}": comments.get(item.lineno, "")
            for node in ast.parse(source).body if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}


def fields_help(width: int | None = None) -> str:
    """Every config field: the value configs/default.gin gives it (the class default where that
    differs, the preset's for a model field left None) and what it means, wrapped to `width`
    (default the terminal's; 80 when output is not a terminal): each meaning beside its setting
    where there is room, else under it."""
    width = width or shutil.get_terminal_size().columns
    gin.clear_config()
    with _gin_reads_our_way():
        gin.parse_config_file(str(_default_gin()))
    based = {cls.__name__: cls() for cls in CLASSES}
    gin.clear_config()
    preset = presets.resolve(based["ModelConfig"])  # what a None model field runs with
    meanings, settings = field_meanings(), {}
    for cls in CLASSES:
        for field in dataclasses.fields(cls):
            name = f"{cls.__name__}.{field.name}"
            value = getattr(based[cls.__name__], field.name)
            settings[name] = f"{name} = {value!r}"
            if value != field.default:
                settings[name] += f" (class default {field.default!r})"
            if cls is ModelConfig and value is None and getattr(preset, field.name) is not None:
                settings[name] += f" (preset {preset.preset!r}: {getattr(preset, field.name)!r})"
    column = 2 + max(map(len, settings.values())) + 2  # where the meanings start, beside their settings
    beside = width - column >= 30  # else a meaning a few words a line would be harder to read than under
    wrap = functools.partial(textwrap.wrap, break_long_words=False, break_on_hyphens=False)
    lines = []
    for cls in CLASSES:
        summary = " ".join(inspect.getdoc(cls).split(chr(10) * 2)[0].split())
        lines += wrap(f"{cls.__name__}: {summary}", width, subsequent_indent="    ")
        for field in dataclasses.fields(cls):
            name = f"{cls.__name__}.{field.name}"
            if beside:
                meaning = wrap(meanings.get(name, ""), width - column) or [""]
                lines.append(f"  {settings[name]:<{column - 2}}{meaning[0]}".rstrip())
                lines += [" " * column + line for line in meaning[1:]]
            else:
                lines.append(f"  {settings[name]}")
                lines += wrap(meanings.get(name, ""), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "fields (value in configs/default.gin):\n" + "\n".join(lines)

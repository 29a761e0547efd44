"""Every command that README.md, REPRODUCING.md and the pages under docs/ show is checked against the code,
without running it (tests/docs_commands.py reads them out of the code blocks):

- each `--config.KEY=VALUE` is applied, with experiments.apply_overrides as `python -m train` applies it,
  to the experiment its `--config FILE[:ARG]` names (experiments/default.py where none is given), loaded
  by experiments.load_experiment: a key the experiment does not have fails, naming it;
- each other `--flag` is one that the command's own argparse parser defines: the parser is taken from the
  entry point's main() as it is about to parse (python -m PKG runs PKG/__main__.py; python
  scripts/NAME.py its main()), so a flag that was renamed or removed fails;
- `python -m jobs.launch` and `python -m jobs.submit` pass what follows `--` to `python -m train`, which
  is checked as such; `jobs.sweep` and `jobs.search` take --config and its overrides as train does.

A failure names the file and line of the command, and the key or flag. Placeholders stay as written:
`--config experiments/FILE.py[:ARG]` is a usage line (skipped), an ARG that is a path (a pretrained run,
`table3.py:cpu,corpus=DIR`) falls back to the experiment's smoke variant, and a shell variable in the
experiment's name (`experiments/${run#*:}.py:$size`) checks every file and ARG it can stand for.
Also checked: every `--config.SECTION.KEY` the documents mention anywhere, in prose too, is a key of at
least one shipped experiment; README.md stays within 200 lines and every other page within 250; CI
(.ci/run) runs the README's install and test commands.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import io
import re
import sys
from unittest import mock

import ml_collections
import pytest

import experiments
from docs_commands import ROOT, Command, all_commands, commands, doc_files

EXPERIMENT_MODULES = ("train", "jobs.sweep", "jobs.search")   # --config FILE[:ARG] and --config.* overrides
FORWARD_TO_TRAIN = ("jobs.launch", "jobs.submit")            # `-- TRAIN ARGS`
DEFAULT_EXPERIMENT = "experiments/default.py"
USAGE_PLACEHOLDER = re.compile(r"\b(FILE|SECTION|KEY|NAME)\b")  # a usage line's names, not real ones


class _Parsing(Exception):
  def __init__(self, parser):
    super().__init__("parser captured")
    self.parser = parser


@functools.lru_cache(maxsize=None)
def parser_of(module: str | None, script: str | None) -> argparse.ArgumentParser:
  """The argparse parser that `python -m module` (or `python script`) builds, captured as its main() is
  about to parse (nothing after that runs)."""
  if script:
    spec = importlib.util.spec_from_file_location(f"_docs_script_{pathlib_stem(script)}", ROOT / script)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
  else:
    package = (ROOT / module.replace(".", "/")).is_dir()
    entry = importlib.import_module(f"{module}.__main__" if package else module)
  main = getattr(entry, "main", None)
  if main is None:
    raise AssertionError(f"{module or script} has no main() to take its parser from")

  def capture(self, *args, **kwargs):
    raise _Parsing(self)
  with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
       mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
       mock.patch.object(sys, "argv", [module or script]), contextlib.redirect_stdout(io.StringIO()):
    try:
      main([]) if inspect.signature(main).parameters else main()
    except _Parsing as parsing:
      return parsing.parser
  raise AssertionError(f"{module or script}: main() returned without parsing its arguments")


def pathlib_stem(script: str) -> str:
  return script.rsplit("/", 1)[-1].removesuffix(".py")


@functools.lru_cache(maxsize=None)
def _load(spec: str) -> ml_collections.ConfigDict:
  return experiments.load_experiment(spec)


def experiment_configs(spec: str) -> tuple[list[tuple[str, ml_collections.ConfigDict]], str | None]:
  """--config's FILE[:ARG] -> ([(what was loaded, config)], None) or ([], why it cannot be loaded)."""
  match = re.fullmatch(r"(.*?\.py)(?::(.*))?", spec)   # FILE.py[:ARG] (a ':' inside ${...} is the shell's)
  path, arg = (match.group(1), match.group(2) or "") if match else (spec, "")
  path, arg = path.replace("$PWD", str(ROOT)), arg.replace("$PWD", str(ROOT))
  pattern = re.sub(r"\$\{[^}]*\}|\$\w+", "*", path)
  files = sorted(ROOT.glob(pattern)) if pattern != path else [ROOT / path]
  files = [f for f in files if not f.name.startswith("_")]
  if not files or not all(f.is_file() for f in files):
    return [], f"experiment file {path!r} does not exist"
  out = []
  for file in files:
    args = [arg or None]
    if "$" in arg:   # a shell variable: every ARG the file declares
      args = list(getattr(experiments.load_module(file), "ARGS", (None, "smoke")))
    for one in args:
      name = f"{file.relative_to(ROOT)}" + (f":{one}" if one else "")
      try:
        out.append((name, _load(f"{file}:{one}" if one else str(file))))
      except (FileNotFoundError, ValueError) as error:
        if isinstance(error, ValueError) and "/" not in str(one):
          return [], f"{name}: {error}"
        # A path (a pretrained run, a corpus not built here): the file's smoke variant has its keys.
        out.append((f"{file.relative_to(ROOT)}:smoke (for {one})", _load(f"{file}:smoke")))
  return out, None


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
  return set(parser._option_string_actions)   # every --flag and alias the parser accepts


def check_train_args(command: Command, module: str, args: list[str]) -> list[str]:
  """Failures of `python -m module ARGS` where module takes an experiment (train, jobs.sweep, jobs.search)."""
  failures, spec, overrides = [], None, []
  i = 0
  while i < len(args):
    token = args[i]
    if token == "--config" and i + 1 < len(args):
      spec, i = args[i + 1], i + 2
      continue
    if token.startswith("--config="):
      spec = token.split("=", 1)[1]
    elif token.startswith("--config."):
      if "=" not in token and module == "train":
        failures.append(f"{command.where}: {token}: python -m train takes --config.KEY=VALUE (with '=')")
      overrides.append(token.removeprefix("--config."))
    i += 1
  if spec is not None and USAGE_PLACEHOLDER.search(spec) or any(USAGE_PLACEHOLDER.search(o) for o in overrides):
    return failures   # the usage line `--config experiments/FILE.py[:ARG] ... [--config.SECTION.KEY=VALUE]`
  loaded, why = experiment_configs(spec or DEFAULT_EXPERIMENT)
  if why:
    return failures + [f"{command.where}: --config {spec}: {why}"]
  for override in overrides:
    key, _, value = override.partition("=")
    for name, config in loaded:
      try:
        experiments.apply_overrides(copy.deepcopy(config), {key: value or "0"})
      except KeyError as error:
        failures.append(f"{command.where}: --config.{key}: not a key of {name} "
                        f"({str(error).strip(chr(34) + chr(39))})")
        break
      except (TypeError, ValueError):
        pass   # a placeholder value (`$TFDS_DIR`, `N`): the key exists
  return failures


def check_flags(command: Command, module: str | None, script: str | None, args: list[str]) -> list[str]:
  """Failures of the --flags in `args` against the command's own parser (--config.* excepted where the
  command takes an experiment)."""
  parser = parser_of(module, script)
  known, failures = _option_strings(parser), []
  for token in args:
    if not token.startswith("--") or token == "--":
      continue
    flag = token.split("=", 1)[0]
    if flag.startswith("--config.") and module in EXPERIMENT_MODULES:
      continue
    if flag not in known:
      failures.append(f"{command.where}: {flag}: not a flag of python {'-m ' + module if module else script} "
                      f"(it has {', '.join(sorted(f for f in known if f.startswith('--')))})")
  return failures


def check(command: Command) -> list[str]:
  """Every failure of one documented command."""
  args, module = command.args, command.module
  failures = []
  if module in FORWARD_TO_TRAIN and "--" in args:
    cut = args.index("--")
    failures += check_flags(command, module, None, args[:cut])
    failures += check_flags(command, "train", None, args[cut + 1:])
    failures += check_train_args(command, "train", args[cut + 1:])
    return failures
  failures += check_flags(command, module, command.script, args)
  if module in EXPERIMENT_MODULES:
    failures += check_train_args(command, module, args)
  return failures


# ------------------------------------------------------------------------------------------------------
COMMANDS = all_commands()


def test_the_documents_show_the_commands_the_test_checks():
  """The reader finds the commands (not a test that passes on nothing): the READMEs' and the guides'."""
  shown = {(c.path.name, c.module or c.script) for c in COMMANDS}
  assert len(COMMANDS) >= 60, len(COMMANDS)
  for expected in (("README.md", "train"), ("README.md", "decode"), ("REPRODUCING.md", "train"),
                   ("pretrained.md", "export.load_hf"), ("pretrained.md", "export"),
                   ("back_translation.md", "decode"), ("multihost.md", "jobs.submit")):
    assert expected in shown, expected


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_names_keys_and_flags_that_exist(path):
  failures = [failure for command in COMMANDS if command.path == path for failure in check(command)]
  assert not failures, "documented commands that do not work as written:\n" + "\n".join(failures)


def _known_keys() -> set[str]:
  """Every SECTION.KEY of every shipped experiment, each ARG (variants that need a corpus not built here
  skipped)."""
  keys = set()
  for file in sorted((ROOT / "experiments").glob("*.py")):
    if file.name.startswith("_"):
      continue
    for arg in getattr(experiments.load_module(file), "ARGS", (None, "smoke")):
      try:
        config = _load(f"{file}:{arg}" if arg else str(file))
      except FileNotFoundError:
        continue
      keys |= {f"{section}.{key}" for section, values in config.items()
               if isinstance(values, ml_collections.ConfigDict) for key in values}
  return keys


def test_every_config_key_the_documents_mention_is_one_a_shipped_experiment_declares():
  """`--config.model.dtype` in a table or a sentence is a command a reader will type: it must exist."""
  known, failures = _known_keys(), []
  mention = re.compile(r"--config\.([a-z_]+\.[A-Za-z_0-9]+)")
  for path in doc_files():
    for number, line in enumerate(path.read_text().splitlines(), 1):
      for key in mention.findall(line):
        if key not in known and not USAGE_PLACEHOLDER.search(key):
          failures.append(f"{path.relative_to(ROOT)}:{number}: --config.{key}: no shipped experiment "
                          f"declares it")
  assert not failures, "\n".join(failures)


README_MOST_LINES = 200   # a newcomer reads it in one sitting; details go to docs/
PAGE_MOST_LINES = 250     # past that a page is split by topic


def test_the_readme_and_every_docs_page_stay_short():
  """README.md within 200 lines, REPRODUCING.md and every page under docs/ (results READMEs included)
  within 250: a page that grows past it is split by topic, not left to grow."""
  sizes = {path: len(path.read_text().splitlines())
           for path in [ROOT / "README.md", ROOT / "REPRODUCING.md", *sorted((ROOT / "docs").rglob("*.md"))]}
  limit = lambda path: README_MOST_LINES if path == ROOT / "README.md" else PAGE_MOST_LINES
  too_long = [f"{path.relative_to(ROOT)}: {n} lines, more than {limit(path)}"
              for path, n in sizes.items() if n > limit(path)]
  assert len(sizes) > 30 and not too_long, "\n".join(too_long) or len(sizes)


def test_ci_runs_the_readmes_install_and_test_commands():
  """What the README tells a newcomer to run is what CI runs (.ci/run: the install, then the suite)."""
  readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
  assert "pip install -e '.[test,interop]' -c constraints.txt" in readme
  assert "pip install -q -e '.[test,interop]' -c constraints.txt" in ci   # the same, quietly
  assert "python -m pytest -q -n auto" in readme and "python -m pytest -q -n auto" in ci


def test_the_checker_names_the_file_line_and_the_unknown_key_or_flag(tmp_path):
  """A document with a misspelt key, a removed flag, a key of another experiment and a good command."""
  doc = tmp_path / "guide.md"
  doc.write_text("Intro.\n\n```bash\n# a comment\npython -m train --config experiments/default.py:smoke \\\n"
                 "    --config.model.num_encoder_layerz=4 --workdir /tmp/x\n"
                 "python -m decode --workdir RUN --beam 4   # --beam_size is the flag\n```\n\n"
                 "    F=\"--config.data.synthetic_path=a.tsv\n       --config.train.num_steps=3\"\n"
                 "    python -m train $F --workdir runs/x\n\n"
                 "```bash\npython -m train --config experiments/back_translation.py:bt "
                 "--config.data.synthetic_path=s.tsv --workdir runs/ok\n```\n")
  found = commands(doc)
  assert [(c.line, c.module) for c in found] == [(5, "train"), (7, "decode"), (12, "train"), (15, "train")]
  found = [dataclass_with(c, tmp_path) for c in found]
  failures = [failure for command in found for failure in check(command)]
  assert len(failures) == 3, failures
  assert failures[0].startswith("guide.md:5: --config.model.num_encoder_layerz: not a key of "
                                "experiments/default.py:smoke")
  assert failures[1].startswith("guide.md:7: --beam: not a flag of python -m decode")
  assert failures[2].startswith("guide.md:12: --config.data.synthetic_path: not a key of experiments/default.py")


def dataclass_with(command: Command, root) -> Command:
  """The command with a path relative to `root` shown in its `where` (a file outside the repository)."""
  class Here(Command):
    @property
    def where(self) -> str:
      return f"{self.path.relative_to(root)}:{self.line}"
  return Here(**vars(command))

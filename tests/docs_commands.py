"""The commands that README.md, REPRODUCING.md and the pages under docs/ show, read out of their code blocks
(a helper of tests/test_docs_commands.py, not a test module).

A command is a `python -m MODULE ...` or `python scripts/NAME.py ...` of this repository, written in a
fenced code block (```bash, ```sh, ```shell, ```console or unlabelled) or an indented (4-space) block, with
backslash-continued lines joined. Each comes back with its file and line, the module or script it runs,
and its arguments (shell-split, comments dropped, cut at the first `|`, `&&`, `;`, `>` or `2>&1`).
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
STOP = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1", "2>", "1>", ")"}
LAUNCHERS = {"nice", "time", "exec", "srun", "uv", "run", "--", "env", "timeout"}   # words before python
PYTHON = re.compile(r"^(python3?|\.venv/bin/python|uv run python|\$PYTHON)$")


def doc_files() -> list[pathlib.Path]:
  """README.md, REPRODUCING.md and every page under docs/ (the results folders' READMEs too), in that
  order."""
  return [ROOT / "README.md", ROOT / "REPRODUCING.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclasses.dataclass
class Command:
  path: pathlib.Path
  line: int                  # 1-based line of the command's first line
  text: str                  # the logical line, continuations joined
  module: str | None         # `python -m MODULE`
  script: str | None         # `python scripts/NAME.py`
  args: list[str]            # what follows the module or script

  @property
  def where(self) -> str:
    return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(text: str):
  """(first line number, [lines]) of every shell code block: fenced ones, and indented ones outside them."""
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    fence = FENCE.match(lines[i])
    if fence:
      indent, marker, language = fence.groups()
      body, j = [], i + 1
      while j < len(lines) and not lines[j].strip().startswith(marker[:3]):
        body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
        j += 1
      if language.lower() in SHELL_LANGUAGES:
        yield i + 2, body
      i = j + 1
      continue
    if lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
      body, j = [], i
      while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
        body.append(lines[j][4:])
        j += 1
      yield i + 1, body
      i = j
      continue
    i += 1


def _logical_lines(first: int, body: list[str]):
  """(line number, text) with backslash continuations and quotes that span lines joined."""
  start, parts = None, []
  for offset, line in enumerate(body):
    if start is None:
      start = first + offset
    stripped = line.rstrip()
    if stripped.endswith("\\"):
      parts.append(stripped[:-1])
      continue
    parts.append(stripped)
    text = " ".join(part.strip() for part in parts)
    if _split(text) is None and offset + 1 < len(body):   # a quote still open: the next line continues it
      continue
    yield start, text
    start, parts = None, []
  if parts:
    yield start, " ".join(part.strip() for part in parts)


def _split(text: str) -> list[str] | None:
  """Shell words, comments dropped; a usage line's optional groups `[--flag VALUE|OTHER]` read as their
  contents (alternatives joined by '/'). None where a quote is not closed."""
  text = re.sub(r"\[([^\]\[]*)\]", lambda m: m.group(1).replace("|", "/"), text.strip())
  lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;<>")
  lexer.whitespace_split = True
  lexer.commenters = ""   # a '#' starts a comment only as a word's first character (`${run#*:}` is a word)
  try:
    words = list(lexer)
  except ValueError:   # a quote not closed
    return None
  comment = next((i for i, word in enumerate(words) if word.startswith("#")), len(words))
  return words[:comment]


def _variable(token: str) -> str | None:
  """'$F' or '${F}' -> 'F'; anything else -> None."""
  match = re.fullmatch(r"\$\{?([A-Za-z_]\w*)\}?", token)
  return match.group(1) if match else None


def commands(path: pathlib.Path) -> list[Command]:
  """Every `python -m` or `python scripts/*.py` command of this repository in one Markdown file."""
  out = []
  for first, body in _blocks(path.read_text()):
    variables = {}   # NAME=VALUE lines of the block: `$NAME` in a later command stands for VALUE's words
    for line, text in _logical_lines(first, body):
      tokens = _split(text)
      if not tokens:
        continue
      if len(tokens) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]):
        name, _, value = tokens[0].partition("=")
        variables[name] = value.split()
        continue
      tokens = [word for token in tokens for word in variables.get(_variable(token), [token])]
      for i, token in enumerate(tokens):
        if not PYTHON.match(token) or i + 1 >= len(tokens):
          continue
        before = tokens[i - 1] if i else ""
        if i and before not in STOP and before not in LAUNCHERS and "=" not in before and not before.isdigit():
          continue   # "python" inside prose or another command's argument
        rest = tokens[i + 1:]
        cut = next((k for k, t in enumerate(rest) if t in STOP or set(t) <= set("|&;<>")), len(rest))
        rest = rest[:cut]
        module = script = None
        if rest[:1] == ["-m"] and len(rest) > 1:
          module, args = rest[1], rest[2:]
          if not (ROOT / module.split(".")[0]).is_dir() or module.split(".")[0] == "tests":
            continue   # pytest, pip, ...: not ours
        elif rest and rest[0].startswith("scripts/") and rest[0].endswith(".py"):
          script, args = rest[0], rest[1:]
        else:
          continue
        out.append(Command(path, line, text, module, script, args))
  return out


def all_commands() -> list[Command]:
  return [command for path in doc_files() for command in commands(path)]


if __name__ == "__main__":   # python tests/docs_commands.py: list what the test checks
  for command in all_commands():
    print(f"{command.where}: {command.module or command.script} {' '.join(command.args)}")

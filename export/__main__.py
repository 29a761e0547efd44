"""`python -m export`: write a trained run as a Hugging Face or CTranslate2 model directory.

    python -m export --workdir RUN [--checkpoint STEP|averaged|latest] --format hf|ctranslate2 --out DIR
"""
from __future__ import annotations

import argparse

import run
from export import FORMATS, UnsupportedOption, export_run


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="run directory written by `python -m train`")
  parser.add_argument("--checkpoint", type=run.checkpoint_arg, default=None,
                      help="step number, 'averaged' or 'latest' (default)")
  parser.add_argument("--format", required=True, choices=FORMATS)
  parser.add_argument("--out", required=True, help="output directory (created; files are overwritten)")
  args = parser.parse_args(argv)
  try:
    out = export_run(args.workdir, args.format, args.out, args.checkpoint)
  except UnsupportedOption as error:
    parser.exit(2, f"error: {error}\n")
  print(f"wrote {args.format} export of {args.workdir} to {out}")


if __name__ == "__main__":
  main()

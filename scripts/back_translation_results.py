"""Summarises the runs of experiments/back_translation.py: writes OUT/results.json and OUT/results.md
(the table that docs/back_translation.md and the experiment's docstring quote).

    python scripts/back_translation_results.py --runs runs --out docs/back_translation_results

Reads RUNS/<run>/metrics.jsonl of each run below that exists (test sacreBLEU of the final and of the
averaged parameters, the dev loss, the last training nll, the steps) and RUNS/<run>.log, the console of
the command run under `/usr/bin/time -v` (its wall-clock time, and the training stream's line).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re

import sacrebleu

RUNS = {   # run directory -> what it is
    "bt_reverse": "reverse model, Romanian->English, parallel half",
    "bt_baseline": "forward, English->Romanian, parallel half only",
    "bt_tagged": "forward, parallel half + back-translated half, tagged <BT>",
    "bt_untagged": "forward, parallel half + back-translated half, untagged",
    "bt_oracle": "forward, both halves with their real English (the upper bound)",
    "bt_tagged_seed1": "as bt_tagged, --config.seed=1",
    "bt_untagged_seed1": "as bt_untagged, --config.seed=1",
}
DECODE_LOG = "bt_decode.log"   # the bulk decoding of the monolingual half, under /usr/bin/time -v


def synthetic_bleu(split_dir: pathlib.Path) -> float | None:
  """sacreBLEU of the synthetic sources (synth.src) against the real sources of the monolingual half
  (mono.src, never trained on): how right the reverse model's translations are."""
  hyp, ref = split_dir / "synth.src", split_dir / "mono.src"
  if not (hyp.exists() and ref.exists()):
    return None
  return sacrebleu.corpus_bleu(hyp.read_text().split("\n")[:-1], [ref.read_text().split("\n")[:-1]]).score


def wall_seconds(log: pathlib.Path) -> float | None:
  """`/usr/bin/time -v`'s "Elapsed (wall clock) time" in a console log, in seconds."""
  if not log.exists():
    return None
  found = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", log.read_text(errors="replace"))
  if not found:
    return None
  hours, minutes, seconds = found.groups()
  return round(int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds), 1)


def summary(run: pathlib.Path, log: pathlib.Path) -> dict:
  lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
  last = lambda key: next((line[key] for line in reversed(lines) if key in line), None)
  dev = [(line["step"], line["eval/loss"]) for line in lines if "eval/loss" in line]
  config = json.loads((run / "config.json").read_text())
  stream = re.search(r"\[data\] training stream: (.*)", log.read_text(errors="replace")) if log.exists() else None
  return {
      "steps": max(line["step"] for line in lines),
      "train_path": config["data"]["train_path"],
      "synthetic_path": config["data"].get("synthetic_path", ""),
      "synthetic_tag": config["data"].get("synthetic_tag", ""),
      "synthetic_ratio": config["data"].get("synthetic_ratio", None),
      "stream": stream.group(1) if stream else None,
      "test_bleu": last("test/bleu"),
      "test_bleu_averaged": last("test/bleu_averaged"),
      "test_signature": last("test/signature"),
      "dev_loss_last": dev[-1][1] if dev else None,
      "dev_loss_best": min(dev, key=lambda d: d[1]) if dev else None,
      "train_nll_last": last("train/nll"),
      "wall_seconds": wall_seconds(log),
  }


def table(results: dict) -> str:
  rows = ["| run | what | test BLEU (averaged) | dev loss, last (best at step) | last train nll | wall |",
          "| --- | --- | --- | --- | --- | --- |"]
  for name, r in results["runs"].items():
    best = r["dev_loss_best"]
    wall = f"{r['wall_seconds'] / 60:.1f} min" if r["wall_seconds"] else "-"
    rows.append(f"| `{name}` | {RUNS[name]} | **{r['test_bleu']:.2f}** ({r['test_bleu_averaged']:.2f}) | "
                f"{r['dev_loss_last']:.3f} ({best[1]:.3f} at {best[0]}) | {r['train_nll_last']:.3f} | {wall} |")
  if results.get("decode_wall_seconds"):
    synth = results.get("synthetic_bleu")
    rows.append(f"| bulk decoding | `mono.tgt` -> `synth.src` with `bt_reverse` | "
                f"{f'{synth:.2f} (against `mono.src`)' if synth else '-'} | - | - | "
                f"{results['decode_wall_seconds'] / 60:.1f} min |")
  return "\n".join(rows) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", default="runs")
  parser.add_argument("--split_dir", default="corpus/po_enro_bt")
  parser.add_argument("--out", default="docs/back_translation_results")
  args = parser.parse_args()
  runs, out = pathlib.Path(args.runs), pathlib.Path(args.out)
  finished = {name: summary(runs / name, runs / f"{name}.log")
              for name in RUNS if (runs / name / "metrics.jsonl").exists()}
  results = {"runs": {name: r for name, r in finished.items() if r["test_bleu_averaged"] is not None},
             "decode_wall_seconds": wall_seconds(runs / DECODE_LOG),
             "synthetic_bleu": synthetic_bleu(pathlib.Path(args.split_dir))}
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
  (out / "results.md").write_text(table(results))
  print(table(results), end="")


if __name__ == "__main__":
  main()

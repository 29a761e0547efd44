"""Generates docs/performance.md from benchmarks/results/*.json, so that the page cannot drift from them.

    python -m benchmarks.report [--results benchmarks/results] [--out docs/performance.md]

The page is the hand-written introduction (benchmarks/notes/intro.md), one dated section per results
file (tables of medians with their spread, ratios and utilisation), then the other hand-written notes
(benchmarks/notes/*.md, in name order). Edit those notes or rerun a benchmark, never the page itself.
"""
from __future__ import annotations

import argparse
import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
NOTES = HERE / "notes"
PAGE = HERE.parent / "docs" / "performance.md"

TRAIN_LABELS = {"ours": "ours, float32", "ours_bf16": "ours, bfloat16 matmuls",
                "torch": "PyTorch eager, float32", "torch_bf16": "PyTorch eager, autocast bfloat16",
                "torch_compile": "torch.compile, float32",
                "torch_compile_bf16": "torch.compile, autocast bfloat16",
                "ours_baseline": "ours, float32, --baseline checkout"}
DECODE_LABELS = {"ours": "ours, float32", "ours_bf16": "ours, bfloat16 matmuls",
                 "hf": "Hugging Face generate, eager", "hf_compile": "Hugging Face generate, torch.compile",
                 "ct2": "CTranslate2 float32", "ct2_avx2": "CTranslate2 float32, oneDNN capped at AVX2",
                 "ct2_best": "CTranslate2 float32, the faster of the two in each round",
                 "ct2_int8": "CTranslate2 int8_float32",
                 "ours_baseline": "ours, float32, --baseline checkout"}


def _order(name: str) -> int:
  """A decoding row's place in its table: DECODE_LABELS' order (ct2_best beside the two it takes from)."""
  return list(DECODE_LABELS).index(name) if name in DECODE_LABELS else len(DECODE_LABELS)


def _num(x: float) -> str:
  return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _table(header: list[str], body: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _status(row: dict) -> str:
  if row.get("status") == "ready" and "median_s" in row:
    return ""
  return f"{row.get('status', '?')}: {row.get('reason', '')}".replace("|", "/").replace("\n", " ")[:300]


def _rate_cells(row: dict, amount: float) -> list[str]:
  """Median rate and the range of per-run rates (amount / seconds), or blanks."""
  if "median_s" not in row:
    return ["", ""]
  return [_num(amount / row["median_s"]), f"{_num(amount / row['max_s'])}-{_num(amount / row['min_s'])}"]


def _ratio_cell(name: str, ratios: dict) -> str:
  parts = [f"{r['of_medians']:.2f}x {key.split('/')[1]} ({r['min']:.2f}-{r['max']:.2f})"
           for key, r in ratios.items() if key.split("/")[0] == name]
  return "<br>".join(parts)


def _setup(row: dict, task: str) -> str:
  info = row.get("info", {}).get(task, {})
  for key, label in (("compile_s", "compile"), ("first_run_s", "first run")):
    if key in info:
      return f"{label} {info[key]:.1f} s"
  return ""


def render_run(r: dict) -> str:
  """Markdown for one benchmarks/results/throughput*.json."""
  m, a, v = r["machine"], r["args"], r["versions"]
  title = f"default experiment's model (--preset {r['preset']})" if r.get("preset") else "benchmark model"
  if r["args"].get("isa", "native") != "native":
    title += f", every system capped at {r['args']['isa'].upper()} (--isa {r['args']['isa']})"
  if r["args"].get("decode_devices"):
    count = r["args"]["decode_devices"]
    title += f", ours decoding on {count} device{'s' if count > 1 else ''} (--decode_devices {count})"
  out = [f"## Throughput, {title}: {r['date']}", ""]
  if r.get("note"):
    out += [f"> {r['note']}", ""]
  model = r["model"]
  load = r.get("load_average", {})
  out += [f"- Machine: {m['cpu']}, {m['cores']} cores, avx512_bf16 {'yes' if m.get('avx512_bf16') else 'no'}"
          f", amx_bf16 {'yes' if m.get('amx_bf16') else 'no'}"
          + (f"; 1-minute load average {load['start']:.1f} at the start, {load['end']:.1f} at the end"
             if "end" in load else "") + ".",
          "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
          f"- Model: d_model {model['d_model']}, d_ff {model['d_ff']}, {model['num_heads']} heads, "
          f"{model['num_encoder_layers']}+{model['num_decoder_layers']} layers, vocabulary "
          f"{model['vocab_size']}, dropout {model['dropout_rate']}; PyTorch and CTranslate2 use "
          f"{a['threads']} threads.",
          f"- Each system in its own process, round-robin: medians of {a['repeats']} rounds after "
          f"{a['warmup']} warm-up runs, {a['pause']} s idle before each run; the spread is the "
          "slowest-fastest run; a ratio is ours over the peer's speed, of the medians (in brackets: "
          "the lowest and highest ratio within one round).",
          f"- Command: `{r['command']}`"]
  if r.get("baseline"):
    out += [f"- Code: `{r.get('commit', '?')}`; the --baseline checkout (ours_baseline) is `{r['baseline']}`, "
            "timed in the same rounds, so ours over ours_baseline is the speed-up of the change between them."]
  out += [""]
  peak = r.get("peak", {})
  if peak:
    body = [[dtype, *(_rate_cells(row, row["info"]["peak"]["flops"] / 1e9) if "median_s" in row else
                      ["", ""]), _status(row)] for dtype, row in peak.items()]
    out += ["Matmul peak (2048 x 2048 `jnp.dot`, float32 accumulation):", "",
            _table(["operands", "GFLOP/s", "spread", "status"], body), ""]
  f32 = peak.get("float32", {}).get("gflops")
  bf16 = peak.get("bfloat16", {}).get("gflops")
  train = r.get("train")
  if train:
    body = []
    for name, row in train["systems"].items():
      util = ""
      if "gflops" in row and name.startswith("ours") and f32:
        util = f"{row['gflops']:.0f} GFLOP/s, {100 * row['gflops'] / f32:.0f}% of f32 peak"
        if name.endswith("bf16") and bf16:
          util += f", {100 * row['gflops'] / bf16:.0f}% of bf16 peak"
      body.append([TRAIN_LABELS.get(name, name), *_rate_cells(row, train["target_tokens"]),
                   _ratio_cell(name, train["ratios"]), util, _setup(row, "train"), _status(row)])
    out += [f"Training, target tokens/s of one optimizer step ({train['batch']}, "
            f"{train['target_tokens']:,} target tokens, {train['model_flops'] / 1e9:.1f} model GFLOP):",
            "", _table(["system", "tokens/s", "spread", "ours vs peer", "utilisation", "setup", "status"],
                       body), ""]
  decode = r.get("decode")
  if decode:
    for task in ("greedy", "beam"):
      if task not in decode:
        continue
      part = decode[task]
      body = [[DECODE_LABELS.get(name, name), *_rate_cells(row, decode["tokens"]),
               _ratio_cell(name, part["ratios"]), _setup(row, task), _status(row)]
              for name, row in sorted(part["systems"].items(), key=lambda item: _order(item[0]))]
      what = "greedy" if task == "greedy" else f"beam {decode['beam_size']}"
      out += [f"Decoding, {what}: target tokens/s ({a['decode_batch']} sentences x {a['src_len']} "
              f"tokens, exactly {a['decode_len']} generated tokens each):", "",
              _table(["system", "tokens/s", "spread", "ours vs peer", "setup", "status"], body), ""]
  return "\n".join(out)


def render_input_pipeline(r: dict) -> str:
  body = [[s["stage"], f"{s['seconds']:.2f}", f"{s['items']:,}",
           "" if s["target_tokens_per_s"] is None else _num(s["target_tokens_per_s"])] for s in r["stages"]]
  date = f": {r['date']}" if r.get("date") else " (undated)"
  machine = r.get("machine")
  return "\n".join([f"## Input pipeline ({r['config']}){date}", "",
                    "`python -m benchmarks.input_pipeline`: each stage of the data pipeline, timed once"
                    + (f" on {machine['cpu']}, {machine['cores']} cores." if machine else "."), "",
                    _table(["stage", "seconds", "items", "target tokens/s"], body), ""])


def render_trees(r: dict) -> str:
  """Markdown for benchmarks/results/trees.json: the train loop of two checkouts, side by side."""
  body = [[f"`{t['commit']}` ({t['path']})", _num(t["median"]),
           f"{_num(min(t['tokens_per_s']))}-{_num(max(t['tokens_per_s']))}"] for t in r["trees"]]
  ratio = r["ratio_after_over_before"]
  return "\n".join([f"## Two checkouts' train loop: {r['date']}", "",
                    *([f"> {r['note']}", ""] if r.get("note") else []),
                    f"`python -m benchmarks.trees`: {r['steps']} steps of each tree's default experiment, "
                    f"in a fresh process per run, the trees taking turns for {len(r['trees'][0]['tokens_per_s'])}"
                    f" rounds; target tokens/s after the first {r['log_every']} (compiling) steps.", "",
                    f"- Command: `{r['command']}`", "",
                    _table(["tree", "tokens/s (median)", "spread"], body), "",
                    f"After / before: {ratio['median']:.3f}x, the median of the rounds' ratios "
                    f"({ratio['min']:.3f}-{ratio['max']:.3f}).", ""])


def render_kv_cache(r: dict) -> str:
  """Markdown for benchmarks/results/kv_cache.json: cache memory and decoding speed of MHA, GQA, MQA."""
  m = r["model"]
  body = [[x["attention"], str(x["num_kv_heads"]), f"{x['cache_mib']:.2f}", _num(x["tokens_per_s"]),
           f"{_num(x['slowest'])}-{_num(x['fastest'])}",
           f"{x['tokens_per_s'] / r['results'][0]['tokens_per_s']:.2f}x"] for x in r["results"]]
  return "\n".join([f"## KV cache: MHA, GQA, MQA: {r['date']}", "",
                    *([f"> {r['note']}", ""] if r.get("note") else []),
                    f"A decoder-only model (d_model {m['d_model']}, {m['num_heads']} heads, {m['layers']} "
                    f"layers, vocabulary {m['vocab_size']}) greedily decodes {r['length']} tokens for "
                    f"{r['rows']} rows; medians of {r['repeats']} round-robin rounds in one process.", "",
                    f"- Command: `{r['command']}`", "",
                    _table(["attention", "kv heads", "cache MiB", "tokens/s", "spread", "vs MHA"], body), ""])


def render_anatomy(result: dict) -> str:
  """Markdown for benchmarks/results/decode_anatomy.json: a decoding step's parts and two cores at once."""
  steps = result["steps"]
  lines = [f"## Decoding anatomy ({result['task']}, default model): {result['date']}", "",
           *([f"> {result['note']}", ""] if result.get("note") else []),
           f"Code `{result['commit']}`; medians of {next(iter(result['variants'].values()))['runs']} "
           f"round-robin rounds, each variant in its own process, ms per batch of {steps} steps.", "",
           f"- Command: `{result['command']}`", "",
           "| variant | what | ms per batch | spread | ms per step |", "|---|---|---|---|---|"]
  for name, v in result["variants"].items():
    lines.append(f"| {name} | {v['what']} | {v['median_s'] * 1e3:.1f} | {v['min_s'] * 1e3:.1f}-"
                 f"{v['max_s'] * 1e3:.1f} | {v['median_s'] * 1e3 / steps:.2f} |")
  d = result["derived"]
  lines += ["", f"- shares of the full step: self-attention {d['self_attention_share']:.0%}, cross-attention "
            f"{d['cross_attention_share']:.0%}, output layer {d['output_layer_share']:.0%} (from an eighth, "
            "scaled linearly)",
            f"- two processes at once over one core alone: {d['two_at_once_over_one_core']:.2f}x the time; "
            f"full over one core alone: {d['full_over_one_core']:.2f}x"]
  if "one_device_over_full" in d:
    lines += [f"- one device over full (every sentence on one device against one device per core): "
              f"{d['one_device_over_full']:.2f}x the time"]
  return "\n".join(lines)


def render_page(results_dir=RESULTS, notes_dir=NOTES) -> str:
  notes = sorted(pathlib.Path(notes_dir).glob("*.md"))
  intro = [n for n in notes if n.name == "intro.md"]
  sections = [n.read_text().strip() + "\n" for n in intro]
  sections.append("<!-- Generated by `python -m benchmarks.report` from benchmarks/results/*.json and "
                  "benchmarks/notes/*.md; edit those, not this page. -->\n")
  order = lambda path: (path.stem != "throughput", not path.stem.startswith("throughput"), path.name)
  for path in sorted(pathlib.Path(results_dir).glob("*.json"), key=order):
    result = json.loads(path.read_text())
    if result.get("benchmark") == "throughput":
      sections.append(render_run(result) + f"\nSource: `benchmarks/results/{path.name}`.\n")
    elif "ratio_after_over_before" in result:
      sections.append(render_trees(result) + f"\nSource: `benchmarks/results/{path.name}`.\n")
    elif result.get("benchmark") == "decode_anatomy":
      sections.append(render_anatomy(result) + f"\nSource: `benchmarks/results/{path.name}`.\n")
    elif path.stem.startswith("kv_cache"):
      sections.append(render_kv_cache(result) + f"\nSource: `benchmarks/results/{path.name}`.\n")
    elif "stages" in result:
      sections.append(render_input_pipeline(result) + f"\nSource: `benchmarks/results/{path.name}`.\n")
  sections += [n.read_text().strip() + "\n" for n in notes if n.name != "intro.md"]
  return "\n".join(sections)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
  p.add_argument("--results", default=str(RESULTS))
  p.add_argument("--out", default=str(PAGE))
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(render_page(args.results))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()

"""Pictures of what the attention learned: one PNG per layer for encoder self-attention, decoder
self-attention and encoder-decoder (cross) attention, heads side by side, pieces on the axes.

    python -m decode.attention_maps --workdir RUN --input "a sentence" [--output DIR] [--checkpoint STEP]

The sentence is translated with beam search first; the maps are then those of the teacher-forced pass
over (source, BOS + translation). The weights are model/attention.py's `attention_weights`, the function
the model attends with (a switch of `visible` or `scores` shows here as it computes), captured with Flax's
`sow` into the 'intermediates' collection, which only this tool makes mutable, so the train step never
computes them.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np

KINDS = {"encoder/self_attention": "enc_self", "decoder/self_attention": "dec_self",
         "decoder/cross_attention": "cross"}


def attention_maps(model, params, src_ids, tgt_in_ids) -> dict:
  """One sentence -> {(kind, layer): float32 [h, q_len, kv_len]}, kind in enc_self/dec_self/cross."""
  return forward_with_maps(model, params, src_ids, tgt_in_ids)[1]


def forward_with_maps(model, params, src_ids, tgt_in_ids) -> tuple:
  """One teacher-forced pass over one sentence: (float32 logits [len, vocab] over tgt_in_ids, or over
  src_ids for an encoder-only model, attention_maps' dict). decode/explore.py shows both."""
  import jax.numpy as jnp
  src = jnp.asarray([src_ids], jnp.int32) if src_ids else None
  tgt = jnp.asarray([tgt_in_ids], jnp.int32) if tgt_in_ids else None
  logits, state = model.apply({"params": params}, src, tgt, mutable=["intermediates"])
  return np.asarray(logits[0], np.float32), collect_maps(state["intermediates"])


def collect_maps(intermediates) -> dict:
  """The 'intermediates' collection of one sentence -> {(kind, layer): float32 [h, q_len, kv_len]}."""
  maps = {}
  for stack, layers in intermediates.items():
    if stack not in ("encoder", "decoder"):
      continue
    for layer_name, modules in layers.items():
      layer = int(layer_name.split("_")[-1])
      for module, values in modules.items():
        kind = KINDS.get(f"{stack}/{module}")
        if kind is not None:
          maps[(kind, layer)] = np.asarray(values["attention_weights"][0][0], np.float32)   # [h, q, k]
  return maps


def plot(weights, rows, cols, title, path) -> None:
  """weights [h, len(rows), len(cols)] -> a PNG with one panel per head and one colour bar."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  h = weights.shape[0]
  size = 0.28 * max(len(rows), len(cols)) + 1.5
  fig, axes = plt.subplots(1, h, figsize=(size * h + 1.0, size + 0.8), squeeze=False)
  for head, ax in enumerate(axes[0]):
    image = ax.imshow(weights[head], vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), rows if head == 0 else [""] * len(rows), fontsize=7)
    ax.set_title(f"head {head}", fontsize=9)
  fig.colorbar(image, ax=axes[0].tolist(), fraction=0.02, pad=0.02)
  fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def write_maps(model, params, vocab, sentence, out_dir, *, source_eos=False, beam_size=4) -> list:
  """Translates `sentence`, then writes the PNGs into out_dir; returns their paths."""
  from data.vocab import BOS, EOS
  from decode.translate import translate
  cfg = model.cfg
  src_ids = vocab.encode(sentence) + ([EOS] if source_eos else [])
  translation = translate(model, params, vocab, [sentence], beam_size=beam_size, source_eos=source_eos)[0]
  tgt_in = [BOS] + vocab.encode(translation, "target")
  if cfg.arch == "encoder_only":
    tgt_in = []
  maps = attention_maps(model, params, src_ids if cfg.arch != "decoder_only" else [], tgt_in)
  piece = vocab.id_to_piece
  src_pieces, tgt_pieces = [piece(i) for i in src_ids], [piece(i) for i in tgt_in]
  axes = {"enc_self": (src_pieces, src_pieces), "dec_self": (tgt_pieces, tgt_pieces),
          "cross": (tgt_pieces, src_pieces)}
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for (kind, layer), weights in sorted(maps.items()):
    rows, cols = axes[kind]
    path = out_dir / f"{kind}_layer{layer}.png"
    plot(weights, rows, cols, f"{kind} layer {layer}: {sentence!r} -> {translation!r}", path)
    paths.append(path)
  return paths


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m decode.attention_maps", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a run directory written by python -m train")
  parser.add_argument("--input", required=True, help="the source sentence")
  parser.add_argument("--output", default=None, help="directory for the PNGs (default WORKDIR/attention)")
  parser.add_argument("--checkpoint", default=None, help="a step, or 'averaged' (default: the newest)")
  args = parser.parse_args(argv)
  import run
  from run.user_errors import reported
  with reported():   # user errors: one line `error: ...`, exit status 2
    opened = run.load_run(args.workdir, run.checkpoint_arg(args.checkpoint))
  out = args.output or pathlib.Path(args.workdir) / "attention"
  paths = write_maps(opened.model, opened.params, opened.vocab, args.input, out,
                     source_eos=bool(opened.config.data.get("source_eos", False)))
  for path in paths:
    print(path)


if __name__ == "__main__":
  main()

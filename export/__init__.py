"""Export a trained run to Hugging Face (MarianMTModel, or Pegasus for pre-norm) or to CTranslate2.

    python -m export --workdir RUN [--checkpoint STEP|averaged|latest] --format hf|ctranslate2 --out DIR

export/weights.py holds what both share (checks, the d_model permutation, the neutral weight dict);
export/hf.py and export/ct2.py write one format each. Both need the `interop` extra:
pip install -e '.[interop]'.
"""
from __future__ import annotations

import functools
import json
import pathlib
import sys

import data
import run
from model.config import as_dtype
from decode import DEFAULTS
from export.usage import usage
from export.weights import FORMATS, UnsupportedOption, check_exportable

__all__ = ["FORMATS", "UnsupportedOption", "check_exportable", "export_run"]


def export_run(workdir, fmt: str, out_dir, checkpoint=None) -> pathlib.Path:
  """Exports run `workdir` (checkpoint None = latest, a step, or 'averaged') to `fmt` in `out_dir`.

  The architecture is checked against the format before any checkpoint is read. Returns the directory.
  """
  if fmt not in FORMATS:
    raise ValueError(f"--format {fmt!r}: use one of {FORMATS}")
  opened = run.load_run(workdir, checkpoint, check=functools.partial(check_exportable, fmt=fmt))
  cfg, spm_path = opened.model_config, pathlib.Path(opened.vocab.path)
  compute = cfg.compute
  if compute.matmul_dtype is not None and as_dtype(compute.matmul_dtype) != as_dtype(compute.dtype):
    print(f"note: {workdir} computes its matmuls with {compute.matmul_dtype} operands (mixed precision); the "
          f"exported model computes them in float32 from the same float32 weights, so its logits differ "
          f"from ours by that rounding", file=sys.stderr)
  source_eos = data.source_eos(opened.config.data)
  decoding = {**DEFAULTS, **(opened.config.decode.to_dict() if "decode" in opened.config else {})}
  if fmt == "hf":
    from export import hf   # torch and transformers: only for this format
    out = hf.export_hf(opened.params, cfg, opened.vocab, spm_path, out_dir, beam_size=decoding["beam_size"],
                       alpha=decoding["alpha"])
  else:
    from export import ct2   # ctranslate2: only for this format
    out = ct2.export_ctranslate2(opened.params, cfg, opened.vocab, spm_path, out_dir, source_eos=source_eos)
  hf_class = hf.hf_class_name(cfg) if fmt == "hf" else ""
  (out / "README.md").write_text(usage(fmt, out.absolute(), source_eos=source_eos,
                                       beam_size=int(decoding["beam_size"]), alpha=float(decoding["alpha"]),
                                       max_len=cfg.max_len, hf_class=hf_class))
  (out / "aiayn_export.json").write_text(json.dumps(
      {"workdir": str(pathlib.Path(workdir).absolute()), "step": int(opened.step),
       "checkpoint": "latest" if checkpoint is None else str(checkpoint), "format": fmt,
       "source_eos": source_eos, "layer_norm_epsilon": cfg.layer_norm_epsilon,
       "beam_size": int(decoding["beam_size"]), "alpha": float(decoding["alpha"]),
       "max_len": cfg.max_len}, indent=2) + "\n")
  return out

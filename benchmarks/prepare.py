"""Writes one benchmark run's shared files (benchmarks/files.py): our random init, its exports, the inputs.

    python -m benchmarks.prepare SPEC_JSON        (the harness runs this in a process of its own)

This process imports JAX, and PyTorch and CTranslate2 for the exports, and exits before any timing
starts; every timed system later loads these files in a fresh process that imports only itself.
"""
from __future__ import annotations

import json
import pathlib
import sys
import types

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import files
from data.batching import BatchIterator
from export import ct2 as ct2_export
from export import hf as hf_export
from model import Compute, Transformer, TransformerConfig


def random_batch(rng, rows: int, src_len: int, tgt_len: int, vocab: int) -> dict:
  """An unpacked batch without padding, in the data/ batch contract: every row one pair."""
  src = rng.integers(4, vocab, (rows, src_len)).astype(np.int32)
  tgt = rng.integers(4, vocab, (rows, tgt_len)).astype(np.int32)
  tgt_in = np.concatenate([np.full((rows, 1), files.BOS, np.int32), tgt[:, :-1]], axis=1)
  tgt_out = np.concatenate([tgt[:, :-1], np.full((rows, 1), files.EOS, np.int32)], axis=1)
  ones = lambda n: np.ones((rows, n), np.int32)
  positions = lambda n: np.broadcast_to(np.arange(n, dtype=np.int32), (rows, n)).copy()
  return {"src": src, "src_segments": ones(src_len), "src_positions": positions(src_len),
          "tgt_in": tgt_in, "tgt_out": tgt_out, "tgt_segments": ones(tgt_len),
          "tgt_positions": positions(tgt_len)}


def packed_batch(rng, max_len: int, batch_tokens: int, vocab: int) -> dict:
  """One packed batch as the default experiment trains on (data/batching.py packing, several pairs per
  row): random pairs of 6-20 tokens a side (the synthetic corpus averages 12-13 pieces a sentence)."""
  lengths = rng.integers(6, 21, (4 * batch_tokens // 6, 2))
  src_ids = [rng.integers(4, vocab, n).tolist() for n in lengths[:, 0]]
  tgt_ids = [rng.integers(4, vocab, n).tolist() for n in lengths[:, 1]]
  iterator = BatchIterator(src_ids, tgt_ids, max_len=max_len, batch_tokens=batch_tokens, row_multiple=1,
                           seed=0, pack=True)
  return next(iterator)


def exported(write) -> str:
  """Runs one export; returns 'ok' or why it could not be written (a peer that is not installed)."""
  try:
    write()
    return "ok"
  except ImportError as error:
    return f"absent: {type(error).__name__}: {error}"


def main(argv=None) -> None:
  spec = json.loads((argv or sys.argv[1:])[0])
  out = pathlib.Path(spec["dir"])
  out.mkdir(parents=True, exist_ok=True)
  cfg = TransformerConfig(**{**spec["model"], "compute": Compute(**spec["model"].get("compute", {}))})
  rng = np.random.default_rng(spec.get("seed", 0))

  t = spec["train"]
  batch = (packed_batch(rng, t["tgt_len"], t["rows"] * t["tgt_len"], cfg.vocab_size) if t["packed"]
           else random_batch(rng, t["rows"], t["src_len"], t["tgt_len"], cfg.vocab_size))
  np.savez(out / files.TRAIN_BATCH, **batch)
  d = spec["decode"]
  src = rng.integers(4, cfg.vocab_size, (d["batch"], d["src_len"])).astype(np.int32)
  np.save(out / files.DECODE_SRC, src)

  ids = jnp.ones((1, 2), jnp.int32)
  params = jax.device_get(Transformer(cfg).init({"params": jax.random.key(spec.get("seed", 0))}, ids, ids)
                          ["params"])
  (out / files.PARAMS).write_bytes(flax.serialization.msgpack_serialize(params))

  vocab = types.SimpleNamespace(pad_id=files.PAD, unk_id=files.UNK, bos_id=files.BOS, eos_id=files.EOS,
                                size=cfg.vocab_size)
  status = {}
  if "marian" in spec["exports"]:
    status["marian"] = exported(
        lambda: hf_export.to_marian(params, cfg, vocab).save_pretrained(out / files.MARIAN))
  if "ct2" in spec["exports"]:
    status["ct2"] = exported(lambda: ct2_export.save_ctranslate2(
        ct2_export.ctranslate2_spec(params, cfg, vocab, files.pieces(cfg.vocab_size)), out / files.CT2))
  (out / files.PREPARED).write_text(json.dumps(status, indent=2) + "\n")


if __name__ == "__main__":
  main()

"""Decoding: beam search and sampling over a tokens-to-logits callback, translation of raw text, BLEU,
and translation of a corpus in resumable parts shared by workers (job.py, bulk.py, progress.py, slurm.py).

DEFAULTS are the paper's decoding settings (Section 6.1: beam 4, length penalty alpha 0.6, GNMT's ((5 + length) / 6) ** alpha, at most source
length + 50 tokens) plus our batch size; `translate`, `python -m decode` and experiments/default.py all
take them from here.

batch_tokens counts per device: every device of a batch gets rows * beam * padded source length <= it,
so a batch grows with the devices that share it. 0 (the default) is the device's own default,
DEVICE_BATCH_TOKENS: 4,096 on a CPU device (one core), 65,536 on a GPU or TPU chip (docs/decoding.md).
"""
DEFAULTS = dict(beam_size=4, alpha=0.6, max_extra_len=50, batch_tokens=0)
DEVICE_BATCH_TOKENS = dict(cpu=4096, gpu=65536, tpu=65536)


def device_batch_tokens(batch_tokens: int, platform: str) -> int:
  """Tokens per device of a batch: batch_tokens, or for 0 the default of a `platform` device."""
  if batch_tokens:
    return int(batch_tokens)
  kind = "gpu" if platform in ("cuda", "rocm") else platform
  return DEVICE_BATCH_TOKENS.get(kind, DEVICE_BATCH_TOKENS["gpu"])

"""What CPU this is: its model, cores and the instruction-set flags that decide bfloat16 speed.

Read from /proc/cpuinfo (Linux; elsewhere the flags read as absent) and nothing else imported, so that
the benchmark harness can record it without loading JAX. It describes a measurement's machine; no
experiment reads it (tests/test_experiments.py): a config is the same on every CPU, and bfloat16 is an
experiment's argument (small_corpus.py:bf16), since a CPU flag does not say that bfloat16 is faster.
"""
from __future__ import annotations

import os
import pathlib
import platform
import re


def machine() -> dict:
  """CPU model, cores and the instruction-set flags that decide bfloat16 speed (from /proc/cpuinfo)."""
  cpu, flags = platform.processor() or platform.machine(), set()
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    cpu = model.group(1).strip() if model else cpu
    first = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(first.group(1).split()) if first else set()
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
          **{flag: flag in flags for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}}


def has_bfloat16(info: dict) -> bool:
  """Whether machine()'s CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without either, XLA
  emulates bfloat16 matmuls and they run slower than float32."""
  return bool(info.get("avx512_bf16") or info.get("amx_bf16"))

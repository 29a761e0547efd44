"""The device mesh that training and decoding run on: one axis, 'data', over a list of devices.

    mesh = make_mesh()                      # every device of every process: training's mesh
    mesh = make_mesh(jax.local_devices())   # this process's devices: decoding's mesh

Batch rows are split over 'data'; parameters are replicated over it (or, with fsdp, split over it too).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh


def make_mesh(devices=None) -> Mesh:
  """A 1-D mesh with axis 'data' over `devices` (default: every device of every process)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.array(devices).reshape(-1), ("data",))

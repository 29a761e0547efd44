"""The pure train and eval steps, the train state, and how both are laid out on a device mesh
(run/mesh.py's).

    mesh = make_mesh()                                      # run/mesh.py: ('data',) over all devices
    state, shardings = create_state(model, tx, mesh, params_key, fsdp=False)
    step_fn = jit_train_step(model, tx, schedule, mesh, shardings, label_smoothing=0.1, accum_steps=1)
    state, metrics = step_fn(state, place_batch(batch, mesh), train_key)

Data parallel by default: parameters and optimizer state are replicated, batch rows are split over the
'data' axis and XLA inserts the gradient all-reduce. With fsdp=True every array of the state is split over
the same axis on its largest dimension divisible by the number of devices (ZeRO-3 style), and XLA
all-gathers parameters where the computation needs them.
"""
from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from data.batching import BATCH_KEYS, OPTIONAL_BATCH_KEYS   # the data contract: one definition, in data/
from kernels import on_lowering_platform
from model import Transformer
from model.ops import ops_for
from run import programs
from train import loss as loss_lib

# Tokens per chunk and device of the fused output layer and loss (loss.fused_output_losses, every
# platform); 0: full logits (the reference the tests compare with).
DEFAULT_LOSS_CHUNK = 1024


@flax.struct.dataclass
class TrainState:
  step: jax.Array            # int32 []: updates applied so far
  params: Any
  opt_state: Any
  # int32 []: -1 while every step was finite; else the first step whose loss or gradient was not finite.
  # From then on the step leaves the state untouched, so the state is the last good one.
  nonfinite_step: jax.Array


# ----------------------------------------------------------------------------------------------------
# Shardings on the mesh of run/mesh.py.
# ----------------------------------------------------------------------------------------------------
def fsdp_spec(shape, num_shards: int) -> P:
  """Splits the largest dimension divisible by num_shards over 'data'; replicates if there is none."""
  if num_shards > 1:
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in dims:
      if shape[d] % num_shards == 0 and shape[d] >= num_shards:
        spec = [None] * len(shape)
        spec[d] = "data"
        return P(*spec)
  return P()


def state_shardings(abstract_state, mesh: Mesh, fsdp: bool):
  """A NamedSharding per leaf of `abstract_state` (arrays or ShapeDtypeStructs)."""
  size = mesh.devices.size

  def leaf(x):
    return NamedSharding(mesh, fsdp_spec(x.shape, size) if fsdp else P())
  return jax.tree_util.tree_map(leaf, abstract_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows of every batch array are split over 'data'."""
  return NamedSharding(mesh, P("data"))


def place_batch(batch: dict, mesh: Mesh) -> dict:
  """Host batch (dict of numpy int32 [rows, len]) -> dict of global jax arrays sharded by rows.

  Each process passes its own rows (make_array_from_process_local_data), so this also works multi-host.
  """
  sharding = batch_sharding(mesh)
  missing = [key for key in BATCH_KEYS if key not in batch]
  if missing:
    raise KeyError(f"batch has no {missing[0]!r} (keys: {sorted(batch)}); see the batch contract in data/")
  keys = BATCH_KEYS + tuple(key for key in OPTIONAL_BATCH_KEYS if key in batch)
  return {key: jax.make_array_from_process_local_data(sharding, np.asarray(batch[key], np.int32))
          for key in keys}


# ----------------------------------------------------------------------------------------------------
# State.
# ----------------------------------------------------------------------------------------------------
def init_state(params_key, model: Transformer, tx: optax.GradientTransformation) -> TrainState:
  ids = jnp.ones((1, 2), jnp.int32)
  params = model.init({"params": params_key}, ids, ids)["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    nonfinite_step=jnp.full((), -1, jnp.int32))


def create_state(model, tx, mesh: Mesh, params_key, fsdp: bool = False):
  """Initialises parameters and optimizer state directly in their sharded layout.

  Returns (state, shardings) where shardings is a TrainState-shaped tree of NamedShardings.
  """
  init = functools.partial(init_state, model=model, tx=tx)
  shardings = state_shardings(programs.eval_shape(init, params_key), mesh, fsdp)
  state = programs.jit(init, out_shardings=shardings)(params_key)
  return state, shardings


def abstract_state(model, tx, mesh: Mesh, fsdp: bool = False):
  """(ShapeDtypeStructs with shardings, shardings) of the state, without computing anything."""
  init = functools.partial(init_state, model=model, tx=tx)
  shapes = programs.eval_shape(init, jax.random.key(0))
  shardings = state_shardings(shapes, mesh, fsdp)
  abstract = jax.tree_util.tree_map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
  return abstract, shardings


# ----------------------------------------------------------------------------------------------------
# Loss sums for one (micro-)batch.
# ----------------------------------------------------------------------------------------------------
def _loss_sums(params, batch, dropout_key, *, model, label_smoothing, deterministic, chunk_tokens=0):
  """Forward pass -> (smoothed loss sum, aux sums). Every sum is over the scored target tokens: the
  batch's tgt_weights where it has them (decoder-only translation, masked LM), else every real one.

  With chunk_tokens > 0 (every architecture with a decoder) the output projection is fused with the
  loss, chunk_tokens tokens at a time (loss.fused_output_losses: same sums, no [tokens, vocab] logits in
  memory); otherwise the reference: full logits, then the losses.
  """
  ops = ops_for(model.cfg)
  inputs = dict(src_segments=batch["src_segments"], tgt_segments=batch["tgt_segments"],
                src_positions=batch["src_positions"], tgt_positions=batch["tgt_positions"],
                deterministic=deterministic, rngs=None if deterministic else {"dropout": dropout_key})
  weights = batch["tgt_weights"] if "tgt_weights" in batch else batch["tgt_segments"] != 0
  weights = weights.astype(jnp.float32)                                      # [rows, tgt_len]
  targets = batch["tgt_out"]
  if chunk_tokens and ops.fused_loss:
    y, table = model.apply({"params": params}, batch["src"], batch["tgt_in"], method="features", **inputs)
    bias = params["final_logits_bias"] if model.cfg.logits_bias else None   # Transformer.add_logits_bias
    loss, nll, correct = loss_lib.fused_output_losses(y, table, targets, weights, label_smoothing,
                                                      chunk_tokens, ops.matmul_dtype, bias)
  else:
    logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], **inputs)
    loss = loss_lib.smoothed_cross_entropy(logits, targets, weights, label_smoothing)
    nll = loss_lib.nll(logits, targets, weights)
    correct = loss_lib.correct(logits, targets, weights)
  aux = {"loss": loss, "nll": nll, "correct": correct, "tokens": jnp.sum(weights)}
  return loss, aux


def _grad_sums(params, batch, rng, *, model, label_smoothing, accum_steps, micro_sharding, chunk_tokens):
  """Gradient of the loss SUM and the aux sums, over accum_steps micro-batches of `batch`.

  Micro-batch i takes rows i, i + accum, i + 2 accum, ...: each device keeps its own block of rows, so
  splitting needs no communication.
  """
  grad_fn = jax.grad(_loss_sums, has_aux=True)
  kwargs = dict(model=model, label_smoothing=label_smoothing, deterministic=False, chunk_tokens=chunk_tokens)
  if accum_steps == 1:
    return grad_fn(params, batch, rng, **kwargs)

  def split(x):
    rows, length = x.shape
    x = x.reshape(rows // accum_steps, accum_steps, length).swapaxes(0, 1)   # [accum, rows/accum, len]
    return jax.lax.with_sharding_constraint(x, micro_sharding)
  micro_batches = jax.tree_util.tree_map(split, batch)

  def body(carry, inputs):
    grads, aux = carry
    index, micro = inputs
    g, a = grad_fn(params, micro, jax.random.fold_in(rng, index), **kwargs)
    return (jax.tree_util.tree_map(jnp.add, grads, g), jax.tree_util.tree_map(jnp.add, aux, a)), None

  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  zero_aux = {k: jnp.zeros((), jnp.float32) for k in ("loss", "nll", "correct", "tokens")}
  (grads, aux), _ = jax.lax.scan(body, (zeros, zero_aux), (jnp.arange(accum_steps), micro_batches))
  return grads, aux


# ----------------------------------------------------------------------------------------------------
# The steps.
# ----------------------------------------------------------------------------------------------------
def train_step(state: TrainState, batch: dict, rng, *, model, tx, schedule, label_smoothing: float,
               accum_steps: int = 1, micro_sharding=None, loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK):
  """One optimizer update on one global batch. Pure.

  batch: dict of int32 [rows, len] (rows divisible by devices * accum_steps); rng: the run's train key,
  folded here with the step (so dropout depends only on seed and step, which makes resume exact).
  Returns (new state, metrics dict of float32 scalars).
  """
  rng = jax.random.fold_in(rng, state.step)
  grad_sums = lambda cfg, params, batch, rng: _grad_sums(
      params, batch, rng, model=model.clone(cfg=cfg), label_smoothing=label_smoothing,
      accum_steps=accum_steps, micro_sharding=micro_sharding, chunk_tokens=loss_chunk_tokens)
  grads, aux = on_lowering_platform(grad_sums, model.cfg, state.params, batch, rng)
  tokens = jnp.maximum(aux["tokens"], 1.0)     # real target tokens of the whole global batch
  grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)

  loss = aux["loss"] / tokens
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (state.nonfinite_step < 0)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)
  new_state = TrainState(
      step=jnp.where(ok, state.step + 1, state.step),
      params=keep(params, state.params),
      opt_state=keep(opt_state, state.opt_state),
      nonfinite_step=jnp.where(state.nonfinite_step >= 0, state.nonfinite_step,
                               jnp.where(ok, -1, state.step)))
  nll = aux["nll"] / tokens
  metrics = {"loss": loss, "nll": nll, "ppl": jnp.exp(nll), "accuracy": aux["correct"] / tokens,
             "learning_rate": schedule(state.step), "grad_norm": grad_norm,
             "param_norm": optax.tree.norm(new_state.params), "tokens": aux["tokens"],
             "src_tokens": jnp.sum(batch["src_segments"] > 0).astype(jnp.float32)}   # real, not padding
  return new_state, metrics


def eval_step(params, batch: dict, *, model, label_smoothing: float,
              loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK):
  """Loss sums of one batch with dropout off: {'loss','nll','correct','tokens'} float32 scalars.

  The caller adds them over batches and divides by 'tokens' (see `finish_eval`).
  """
  loss_sums = lambda cfg, params, batch: _loss_sums(
      params, batch, None, model=model.clone(cfg=cfg), label_smoothing=label_smoothing,
      deterministic=True, chunk_tokens=loss_chunk_tokens)[1]
  return on_lowering_platform(loss_sums, model.cfg, params, batch)


def finish_eval(sums: dict) -> dict:
  """Summed eval_step outputs -> {'loss', 'nll', 'ppl', 'accuracy', 'tokens'}."""
  tokens = max(float(sums["tokens"]), 1.0)
  nll = float(sums["nll"]) / tokens
  return {"loss": float(sums["loss"]) / tokens, "nll": nll, "ppl": float(np.exp(nll)),
          "accuracy": float(sums["correct"]) / tokens, "tokens": float(sums["tokens"])}


def jit_train_step(model, tx, schedule, mesh: Mesh, shardings, *, label_smoothing: float,
                   accum_steps: int = 1, loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK):
  """train_step jitted with explicit shardings; the state argument is donated."""
  replicated = NamedSharding(mesh, P())
  fn = functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                         label_smoothing=label_smoothing, accum_steps=accum_steps,
                         loss_chunk_tokens=loss_chunk_tokens * mesh.devices.size,
                         micro_sharding=NamedSharding(mesh, P(None, "data")))
  return programs.jit(fn, in_shardings=(shardings, batch_sharding(mesh), replicated),
                 out_shardings=(shardings, replicated), donate_argnums=0)


def jit_eval_step(model, mesh: Mesh, param_shardings, *, label_smoothing: float,
                  loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK):
  """eval_step jitted with explicit shardings (params are not donated)."""
  fn = functools.partial(eval_step, model=model, label_smoothing=label_smoothing,
                         loss_chunk_tokens=loss_chunk_tokens * mesh.devices.size)
  return programs.jit(fn, in_shardings=(param_shardings, batch_sharding(mesh)),
                 out_shardings=NamedSharding(mesh, P()))

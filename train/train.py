"""The training driver: `train_and_evaluate(config, workdir)`.

Reads top to bottom: run directory, mesh, data, model and optimizer, state (resume), steps, checkpoints,
evaluation, the loop, and the final test-set BLEU. The dev loss, BLEU, early stopping and the end's test
report are train/evaluation.py's; initialisation from another run and the log line are named helpers
beside it, and checkpoint averaging is train/average.py's.

It trains config.data.task (data/tasks.py): translation (the default), decoder-only translation, a
language model or a masked LM; the tasks differ only in their batches, and the last two have no BLEU.

Where the starting state comes from (first match wins):
  1. the newest readable checkpoint in workdir/checkpoints (rerunning a command resumes it exactly:
     parameters, optimizer state, step, RNG and data iterator position);
  2. config.train.init_checkpoint = "RUN_DIR[:STEP|:averaged]": parameters only, fresh optimizer, step 0;
  3. scratch: parameters from config.seed.
A checkpoint whose optimizer state no longer fits (e.g. grad_clip_norm switched on) stops the run naming
the arrays, unless config.train.reset_optimizer=True: then parameters, step and data position are kept
and the optimizer state starts afresh.

Several processes (train/multihost.py): every process runs this same function on its own devices and
its own rows of every batch; checkpoints are written by all of them, everything else (metrics.jsonl,
TensorBoard, the console, the progress bar, the run-directory lock) by process 0 alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from data import (derive_train_max_len, load_pairs, make_eval_batches, make_train_iterator, source_eos, tasks,
                  tokenized)
from model import Transformer
from run import checkpoint as ckpt
from run import Keep, RunDir, checkpoint_arg, model_config
from run import metrics as metrics_io
from run.mesh import make_mesh
from run.user_errors import UserError
from train import evaluation, flops as flops_lib, goodput, multihost, schedules
from train import step as step_lib
from train.multihost import say
from train.optimizer import make_optimizer
from train.signals import SignalFlag

# Keys of metrics.jsonl excluded from "must match on resume": they measure the machine, not the run (the
# padding shares count the empty rows that round a batch up to a multiple of the devices).
TIMING_KEYS = ("train/tokens_per_sec", "train/steps_per_sec", "eval/seconds", "eval/bleu_seconds",
               "train/model_flops_per_sec", "train/mfu", "train/padding", "train/src_padding",
               "train/tgt_slots_per_batch",
               *(f"time/{part}_s" for part in (*goodput.PARTS, "wall")))
# config.train.rng_impl -> jax's PRNG implementation of the dropout key.
RNG_IMPLS = {"threefry": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg"}


class NonFiniteError(RuntimeError):
  """The loss or gradient stopped being finite; the run stopped without saving the bad state."""


@dataclasses.dataclass
class Outcome:
  """What train_and_evaluate returns."""
  workdir: str
  step: int
  interrupted: str | None = None       # name of the signal that stopped the run early, if any
  test_bleu: float | None = None       # of the final parameters
  test_signature: str | None = None
  test_bleu_averaged: float | None = None   # of the average of the last config.train.average_last
  averaged_steps: list | None = None        # checkpoints (None without averaging)
  stopped_early: bool = False          # dev loss stopped improving (config.train.early_stop_evals)
  best_step: int | None = None         # early stopping: the step of the best dev loss, whose checkpoint
                                       # is kept and is the run's model (test BLEU, decode, export)
  samples: list | None = None          # [(source, reference, hypothesis)]
  eval: dict | None = None
  time: dict | None = None             # the run's wall-clock split: train/goodput.py's PARTS, seconds


def _init_from_checkpoint(spec: str, state, shardings):
  """config.train.init_checkpoint = "RUN[:STEP|:averaged]" -> state with that run's parameters (the step
  and the optimizer state stay fresh); parameters of another architecture or vocabulary: UserError."""
  run, _, which = spec.partition(":")
  with RunDir(run) as pretrained:   # the run fine-tuned from, opened once, read-only
    init_params, init_step = pretrained.load_params(checkpoint_arg(which))
  if jax.tree_util.tree_structure(init_params) != jax.tree_util.tree_structure(state.params) or any(
      a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(init_params),
                                         jax.tree_util.tree_leaves(state.params))):
    raise UserError(f"config.train.init_checkpoint={spec!r}: its parameters do not "
                     f"match config.model (different architecture or vocabulary size)")
  say(f"[train] initialised parameters from {run} (step {init_step}); optimizer from scratch")
  return state.replace(params=jax.device_put(init_params, shardings.params))


def _resolve_max_len(config, vocab, derived_before: int) -> None:
  """config.data.max_len=0: set to the value derived from the training split's lengths (printing what it
  keeps and drops), or to `derived_before`, the value a resumed run derived when it began; config.json
  then records it for resuming, decoding and export. Data longer than the model's positions: UserError."""
  if derived_before:
    say(f"[data] data.max_len={derived_before}: derived from the corpus when this run began (config.json)")
  elif int(config.data.max_len) == 0:
    choice = derive_train_max_len(config.data, tokenized(config.data, vocab, "train"))
    say(f"[data] {choice.describe()}")
    config.data.max_len = choice.max_len
  if int(config.data.max_len) > int(config.model.max_len):
    raise UserError(f"config.data.max_len={config.data.max_len} tokens per side exceeds the model's "
                    f"positions, config.model.max_len={config.model.max_len}; raise config.model.max_len "
                    f"to at least {config.data.max_len}, or lower config.data.max_len")


def _train_line(host: list, steps: int, seconds: float) -> dict:
  """A log interval's metrics.jsonl line from its steps' metrics (host copies, oldest first)."""
  line = {f"train/{k}": float(np.mean([float(m[k]) for m in host])) for k in host[-1]}
  line["train/learning_rate"] = float(host[-1]["learning_rate"])
  tokens = float(np.sum([float(m["tokens"]) for m in host]))
  line["train/tokens"] = tokens
  # Real (not padded) tokens per batch, source and target: what config.data.batch_tokens bounds.
  line["train/src_tokens_per_batch"] = line.pop("train/src_tokens", 0.0)
  line["train/tgt_tokens_per_batch"] = tokens / len(host)
  line["train/tokens_per_sec"] = tokens / max(seconds, 1e-9)
  line["train/steps_per_sec"] = steps / max(seconds, 1e-9)
  return line


def train_and_evaluate(config, workdir) -> Outcome:
  """Trains config's experiment in workdir (resuming what is there), evaluates, and returns an Outcome.

  The run directory is opened once, here (run.RunDir: its checkpoint sets, config, vocabulary, metrics,
  lock), and passed on. Raises NonFiniteError if the loss or gradient becomes non-finite (the last good
  checkpoint is kept), run.workdir.RunDirLocked if another trainer holds workdir,
  ckpt.CheckpointMismatch if the newest readable checkpoint does not fit the configured model or
  optimizer (nothing in workdir is changed).
  """
  tasks.check_task(config.data, config.model.get("arch", "encoder_decoder"))
  run = RunDir(workdir, write=_written_sets(config.train)).create()
  with contextlib.ExitStack() as stack:
    if multihost.is_primary():
      stack.enter_context(run.lock())
    stack.callback(run.close)   # the saves finish (and the managers close) before the lock is released
    return _train(config, run)


def _written_sets(tc) -> dict:
  """The checkpoint sets a trainer writes and how each is kept ({directory: run.Keep}); averaging settings
  that cannot be met are a UserError."""
  last, every = int(tc.get("average_last", 0)), int(tc.get("average_every_steps", 0))
  if every < 0:
    raise UserError(f"config.train.average_every_steps={every}: use a number of steps, or 0 to average the "
                    f"newest of RUN/checkpoints")
  if not every and last > int(tc.keep_checkpoints):
    raise UserError(f"config.train.average_last={tc.average_last} averages more checkpoints than "
                     f"config.train.keep_checkpoints={tc.keep_checkpoints} keeps; raise keep_checkpoints")
  written = (int(tc.num_steps) - 1) // every + 1 if every else 0   # steps num_steps, num_steps - every, ...
  if every and last > written and not tc.get("average_allow_fewer", False):
    raise UserError(f"config.train.average_last={last} checkpoints {every} steps apart need more than "
                    f"{(last - 1) * every} steps; config.train.num_steps={tc.num_steps} writes {written}. "
                    f"Lower average_every_steps or average_last, or set config.train.average_allow_fewer=True")
  # Early stopping keeps the best dev loss's checkpoint beside the last keep_checkpoints (its step is set
  # once the state is restored, and at every new best).
  keep_best = ckpt.KeepSteps() if int(tc.get("early_stop_evals", 0)) else None
  sets = {ckpt.CHECKPOINTS: Keep(last=int(tc.keep_checkpoints), also=keep_best)}
  if every:   # the step checkpoints averaged (_StepCheckpoints), the last average_last kept
    sets[ckpt.TO_AVERAGE] = Keep(last=last or None)
  return sets


def _open_run(config, run: RunDir) -> int:
  """The config check against config.json (written once the state is restored). -> the data.max_len
  this run derived when it began (config.data.max_len=0 and checkpoints), else 0."""
  has_checkpoints = bool(run.steps())
  derived_before = 0   # config.data.max_len=0: the value this run derived when it began (config.json)
  if int(config.data.max_len) == 0 and has_checkpoints:
    derived_before = config.data.max_len = run.recorded_max_len()
  changes = run.check_resume(config, has_checkpoints)
  if changes:
    say(f"[train] config changed since the last run in {run.path}: {'; '.join(changes)}")
  return derived_before


@dataclasses.dataclass
class _Data:
  vocab: object
  train_iter: object
  dev_pairs: list
  dev_batches: list


def _load_data(config, run: RunDir, derived_before: int, num_devices: int, accum: int) -> _Data:
  """Vocabulary, the training iterator and the dev batches; batches are padded with empty rows to a
  multiple of devices * accumulation (which pairs form a batch does not depend on it)."""
  primary = multihost.is_primary()
  # Every process: the vocabulary (trained once, by whichever process takes its lock first) and its share
  # of the tokenized corpus (data/cache.py). They wait for each other on the file system, saying for what,
  # so the barrier below waits only for the last to open the cache; process 0 alone writes the run directory.
  vocab = run.get_vocab(config.data, write=primary)
  tokenized(config.data, vocab, "train", progress=primary)
  multihost.barrier("corpus and vocabulary")
  _resolve_max_len(config, vocab, derived_before)
  processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
  train_iter = make_train_iterator(config.data, vocab, seed=config.seed, row_multiple=num_devices * accum,
                                   **processes)
  dev_pairs = load_pairs(config.data, "dev")
  dev_pairs = dev_pairs[:config.train.dev_sentences] if config.train.dev_sentences else dev_pairs
  dev_batches = make_eval_batches(config.data, vocab, dev_pairs, row_multiple=num_devices, **processes)
  return _Data(vocab, train_iter, dev_pairs, dev_batches)


def _keys(config):
  """(params key, the train key of config.train.rng_impl: what dropout draws from, folded per step)."""
  params_key, train_key = jax.random.split(jax.random.key(config.seed))
  name = config.train.get("rng_impl", "threefry")
  if name not in RNG_IMPLS:
    raise UserError(f"config.train.rng_impl={name!r} is not one of {list(RNG_IMPLS)}")
  impl = RNG_IMPLS[name]
  if impl != "threefry2x32":   # the same seed, drawn into a key of the other implementation
    words = jax.random.key_data(jax.random.key(0, impl=impl)).size
    train_key = jax.random.wrap_key_data(jax.random.bits(train_key, (words,), jnp.uint32), impl=impl)
  return params_key, train_key


@dataclasses.dataclass
class _Start:
  state: object
  train_key: object
  pending: list        # per-step metric dicts since the last log line (restored too: exact averages)
  early: dict          # early stopping: the best dev loss so far, the evals since it, whether stopped
  eval_owed: bool      # a signal cut this step's dev evaluation short: the run does it before training on


def _starting_state(config, run: RunDir, model, tx, mesh, vocab, train_iter) -> _Start:
  """Resume > init_checkpoint > scratch (see the module docstring)."""
  tc = config.train
  abstract, shardings = step_lib.abstract_state(model, tx, mesh, fsdp=tc.fsdp)
  params_key, train_key = _keys(config)
  params, opt_state, meta, _ = ckpt.restore_latest(run.checkpoints(), abstract.params, abstract.opt_state,
                                                   reset_optimizer=bool(tc.get("reset_optimizer", False)))
  early = {"best": float("inf"), "bad": 0, "stopped": False}
  if meta is None:
    state, _ = step_lib.create_state(model, tx, mesh, params_key, fsdp=tc.fsdp)
    if tc.init_checkpoint:
      state = _init_from_checkpoint(tc.init_checkpoint, state, shardings)
    return _Start(state, train_key, [], early, False)
  early.update(meta.get("early_stop", {}))
  if meta.get("vocab_fingerprint") not in (None, vocab.fingerprint):
    raise UserError(f"{run.path}/vocab.model does not match the checkpoint's vocabulary "
                     f"({vocab.fingerprint} vs {meta['vocab_fingerprint']}); restore the run's vocab.model")
  if opt_state is None:   # reset_optimizer and the saved state did not fit: a fresh one
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    say(f"[train] config.train.reset_optimizer: step {meta['step']}'s optimizer state does not fit the "
        f"optimizer as configured now; starting it afresh (parameters, step and data position kept)")
  state = step_lib.TrainState(step=jnp.asarray(meta["step"], jnp.int32), params=params,
                              opt_state=opt_state, nonfinite_step=jnp.asarray(-1, jnp.int32))
  try:
    train_iter.set_state(meta["data"])
  except ValueError as error:
    raise ckpt.CheckpointMismatch(f"{run.path / ckpt.CHECKPOINTS / str(meta['step'])}: {error}") from None
  say(f"[train] resumed {run.path} at step {meta['step']}")
  train_key = ckpt.key_from_json(meta["rng"], RNG_IMPLS[tc.get("rng_impl", "threefry")])
  return _Start(jax.device_put(state, shardings), train_key, meta.get("pending_metrics", []), early,
                bool(meta.get("eval_owed", False)))


def _profile_window(spec: str) -> tuple[int, int] | None:
  """config.train.profile_steps "A-B" -> (A, B): trace the steps after step A up to step B."""
  if not spec:
    return None
  first, _, last = str(spec).partition("-")
  try:
    window = int(first), int(last or first)
  except ValueError:
    window = (0, -1)
  if not 0 <= window[0] < window[1]:
    raise UserError(f"config.train.profile_steps={spec!r}: give 'A-B' with 0 <= A < B (e.g. '100-105'): "
                     f"the trace covers the steps after step A up to step B")
  return window


def _train(config, run: RunDir) -> Outcome:
  tc, primary = config.train, multihost.is_primary()
  derived_before = _open_run(config, run)
  keep_best, workdir = run.write[ckpt.CHECKPOINTS].also, run.path

  # Mesh (one 'data' axis over every device of every process), data, model and optimizer.
  mesh = make_mesh()
  data = _load_data(config, run, derived_before, mesh.devices.size, int(tc.grad_accum_steps))
  model = Transformer(model_config(config, data.vocab.size), packed=bool(config.data.get("pack", True)))
  schedule = schedules.make_schedule(tc, config.model.d_model)
  tx = make_optimizer(tc, schedule)
  # MFU (train/flops.py): this process's model FLOPs over its devices' peak.
  meter = flops_lib.Meter(model.cfg, flops_lib.peak_flops(jax.local_devices(), model.cfg,
                                                          float(tc.get("peak_flops", 0.0)))[0],
                          processes=jax.process_count())
  start = _starting_state(config, run, model, tx, mesh, data.vocab, data.train_iter)
  state, pending, early, train_key = start.state, start.pending, start.early, start.train_key
  start_step = int(state.step)
  if keep_best is not None and early.get("best_step") is not None:
    keep_best.steps = {int(early["best_step"])}
  if primary:
    run.save_config(config)
    run.write_versions()

  train_step, eval_step = _jit_steps(tc, model, tx, schedule, mesh, state)
  to_average = _StepCheckpoints.open(run, tc, start_step)

  # Checkpoints: every checkpoint_every_steps steps, every checkpoint_every_minutes, at the end and on
  # SIGTERM/SIGINT; never a state that went non-finite. Apart from them, with average_every_steps, the
  # step checkpoints that are averaged (_StepCheckpoints).
  check_finite = lambda step: _check_finite(state, step, run)

  def save(step, eval_owed=False):   # (clock: assigned before the loop calls it)
    check_finite(step)
    with clock.part("checkpoint"):
      host_pending = [{k: float(v) for k, v in m.items()} for m in jax.device_get(pending)]
      meta = {"step": step, "rng": ckpt.key_to_json(train_key), "data": data.train_iter.get_state(),
              "vocab_fingerprint": data.vocab.fingerprint, "seed": config.seed,
              "pending_metrics": host_pending, "early_stop": dict(early), "eval_owed": eval_owed}
      ckpt.save(run.checkpoints(), step, state.params, state.opt_state, meta)

  # Evaluation. A finished run rerun reports again: its final eval and test lines are rewritten, as are
  # those of an evaluation owed at the step resumed (written by a run killed before it recorded them done).
  writer = metrics_io.NoMetrics()
  if primary:
    writer = run.metrics(resume_step=start_step, tensorboard=tc.tensorboard,
                         drop_reports=start_step >= int(tc.num_steps) or early["stopped"] or start.eval_owed)

  def evaluate(step, with_bleu, stop=lambda: False):
    """The dev metrics, written; None where stop() (a signal) cut them short: nothing is written."""
    with clock.part("eval"):
      t0 = time.time()
      losses = evaluation.dev_losses(eval_step, state.params, data.dev_batches, mesh, stop)
      if losses is None:
        return None
      result = {f"eval/{k}": v for k, v in losses.items()}
      result["eval/seconds"] = time.time() - t0
      if with_bleu:
        t0 = time.time()
        bleu = evaluation.bleu(model, state.params, data.vocab, data.dev_pairs, config.decode,
                               source_eos(config.data), stop)
        if bleu is None:
          return None
        result["eval/bleu"] = bleu[0]
        result["eval/bleu_seconds"] = time.time() - t0
      writer.write(step, result)
    return result

  def dev_eval(step):
    """Step's periodic dev evaluation and early stopping -> (its metrics, None where a signal cut it short;
    whether its dev loss is the best so far)."""
    with_bleu = tasks.translates(config.data) and bool(every(tc.bleu_every, step)) and step != num_steps
    result = evaluate(step, with_bleu=with_bleu, stop=lambda: vote.vote(signals.received is not None))
    if result is None or not int(tc.get("early_stop_evals", 0)):
      return result, False
    new_best = evaluation.early_stop(early, result["eval/loss"], int(tc.early_stop_evals), step)
    if new_best:   # saved and kept: the run's model unless a later eval beats it
      keep_best.steps = {step}
    return result, new_best

  # The loop. Metrics stay on device until a log step; the host never waits on a step otherwise. Its
  # wall-clock, and the end's, split into step, input, eval, checkpoint and compile (train/goodput.py).
  clock = goodput.Goodput()
  num_steps = int(tc.num_steps)
  every = lambda n, step: n and step % n == 0
  last_save_time, last_log_step = time.time(), start_step
  padding, profiler = _Padding(), _Profiler(tc.get("profile_steps", ""), workdir, primary,
                                           python=bool(tc.get("profile_python", False)))
  eval_result = None
  bar = tqdm.tqdm(total=num_steps, initial=start_step, desc="train", disable=not (tc.progress and primary),
                  dynamic_ncols=True)
  step = start_step
  signals = SignalFlag().install()   # only around the loop: elsewhere Ctrl-C interrupts at once
  vote = multihost.StopVote(mesh)  # all processes stop after the same step, whichever got the signal
  stop = False
  try:
    if start.eval_owed:
      # A signal cut this step's evaluation short (the step was saved, then the run stopped): it is done
      # now, from the same parameters, and the checkpoint's meta records it done with its early stopping,
      # so that metrics.jsonl, early stopping and the best checkpoint are an uninterrupted run's.
      eval_result, _ = dev_eval(step)
      stop = eval_result is None
      if not stop and primary:
        run.update_meta(step, {"early_stop": dict(early), "eval_owed": False})
    while step < num_steps and not stop and not early["stopped"]:
      profiler.before(step)
      with clock.part("input"):
        batch = next(data.train_iter)
        meter.add(batch)
        padding.add(batch)
      state, metrics = train_step(state, step_lib.place_batch(batch, mesh), train_key)
      pending.append(metrics)
      step += 1
      bar.update(1)
      stop = vote.vote(signals.received is not None)
      profiler.after(step, state)
      new_best = False

      if every(tc.log_every, step) or step == num_steps:
        check_finite(step)
        host = jax.device_get(pending)   # waits for the interval's last step: its time is step time
        split = clock.close_interval()
        line = _train_line(host, step - last_log_step, split["step"])
        line.update(meter.report(split["step"]), **padding.report(), **goodput.interval_metrics(split))
        writer.write(step, line)
        bar.set_postfix(**_postfix(line))
        pending, last_log_step = [], step

      eval_owed = False
      if every(tc.eval_every, step) or step == num_steps:
        # A signal during the evaluation cuts it short: this step is saved below, owing the evaluation,
        # and the run stops; the resumed run does the evaluation first (above).
        result, new_best = dev_eval(step)
        eval_owed = result is None
        stop, eval_result = stop or eval_owed, result or eval_result

      if to_average is not None and (num_steps - step) % to_average.every == 0:
        check_finite(step)
        with clock.part("checkpoint"):
          to_average.save(step, state.params, data.vocab.fingerprint)
      minutes = (time.time() - last_save_time) / 60
      if (every(tc.checkpoint_every_steps, step) or step == num_steps or stop or early["stopped"] or new_best
          or (tc.checkpoint_every_minutes and minutes >= tc.checkpoint_every_minutes)):
        save(step, eval_owed)
        last_save_time = time.time()
  finally:
    signals.restore()
  bar.close()
  with clock.part("checkpoint"):
    run.wait()   # every save finished: the end reads the checkpoints back (best step, averaging)

  # The end: a stopped run says how to resume; a finished one reports test BLEU (and again when rerun).
  received = (signals.received or "a signal to another process") if stop else None
  outcome = Outcome(str(workdir), step, interrupted=received, eval=eval_result,
                    stopped_early=early["stopped"] and not stop, time=clock.total,
                    best_step=early.get("best_step"))
  try:
    if not stop:
      with clock.part("eval"):
        outcome.eval = eval_result or evaluate(step, with_bleu=False)
        params = state.params
        if outcome.best_step is not None and outcome.best_step != step:   # early stopping: the best model
          params = run.load_params(outcome.best_step)[0]
        if outcome.best_step is not None:
          best = run.path / ckpt.CHECKPOINTS / str(outcome.best_step)
          say(evaluation.best_step_line(outcome, early["best"], best))
        evaluation.report_test(config, run, model, params, data.vocab, writer, step, outcome)
  finally:
    writer.close()
  clock.close_interval()
  say(clock.summary())
  if stop:
    say(f"[train] {received}: saved step {step} in {workdir / ckpt.CHECKPOINTS}; "
        f"rerun the same command to resume")
  return outcome


class _StepCheckpoints:
  """config.train.average_every_steps > 0: the parameters at steps num_steps, num_steps - every, ... in
  RUN/checkpoints_to_average (the last average_last kept; meta marked "to_average"), apart from the
  checkpoints training resumes from, so that a wall-clock or preemption save never joins an average."""

  def __init__(self, manager, every: int):
    self.manager, self.every = manager, every

  @classmethod
  def open(cls, run: RunDir, tc, start_step: int):
    """None without average_every_steps. A resumed run drops the step checkpoints past its step (it writes
    them again, from the state it resumed), and those off its spacing (num_steps or average_every_steps
    changed since they were written), so that an average never mixes two spacings."""
    every, num_steps = int(tc.get("average_every_steps", 0)), int(tc.num_steps)
    if not every:
      return None
    manager = run.checkpoints(ckpt.TO_AVERAGE)   # written: the last average_last kept (_written_sets)
    off = sorted(s for s in manager.all_steps() if s <= start_step and (num_steps - s) % every)
    for step in [s for s in manager.all_steps() if s > start_step] + off:
      manager.delete(step)
    if off:
      say(f"[train] dropped step checkpoints {off} of {run.path / ckpt.TO_AVERAGE}: not {every} steps apart "
          f"counting back from config.train.num_steps={num_steps} (changed since they were written)")
    return cls(manager, every)

  def save(self, step: int, params, vocab_fingerprint) -> None:
    ckpt.save(self.manager, step, params, None, {"step": step, "to_average": self.every,
                                                  "vocab_fingerprint": vocab_fingerprint})


def _jit_steps(tc, model, tx, schedule, mesh, state):
  """The train and eval steps, jitted once with explicit shardings (the state is donated)."""
  shardings = step_lib.state_shardings(state, mesh, tc.fsdp)
  chunk = int(tc.get("loss_chunk_tokens", step_lib.DEFAULT_LOSS_CHUNK))
  train_step = step_lib.jit_train_step(model, tx, schedule, mesh, shardings, label_smoothing=tc.label_smoothing,
                                       accum_steps=int(tc.grad_accum_steps), loss_chunk_tokens=chunk)
  eval_step = step_lib.jit_eval_step(model, mesh, shardings.params, label_smoothing=tc.label_smoothing,
                                     loss_chunk_tokens=chunk)
  return train_step, eval_step


def _check_finite(state, step: int, run: RunDir) -> None:
  """NonFiniteError if the state stopped being finite (the last good checkpoint is kept)."""
  bad = int(state.nonfinite_step)
  if bad >= 0:
    run.wait()
    good = run.checkpoints().latest_step()
    raise NonFiniteError(
        f"non-finite loss or gradient at step {bad} (detected by step {step}); training stopped "
        f"without saving it. Last good checkpoint: "
        f"{run.path / ckpt.CHECKPOINTS / str(good) if good is not None else 'none'}. Try a lower "
        f"config.train.learning_rate, config.train.grad_clip_norm > 0 or a longer warmup.")


def _postfix(line: dict) -> dict:
  """The progress bar's figures from a log line."""
  return dict(loss=f"{line['train/loss']:.3f}", lr=f"{line['train/learning_rate']:.2e}",
              # the real target tokens a step trains on / its target slots (padding included)
              tgt=f"{line['train/tgt_tokens_per_batch']:.0f}/{line['train/tgt_slots_per_batch']:.0f}",
              tok_s=f"{line['train/tokens_per_sec']:.0f}", mfu=f"{line['train/mfu']:.1%}")


class _Profiler:
  """config.train.profile_steps "A-B": a jax.profiler trace of steps A+1..B in workdir/profile
  (process 0)."""

  def __init__(self, spec: str, workdir: pathlib.Path, primary: bool, python: bool = False):
    window = _profile_window(spec)   # checked in every process
    self.window, self.path = window if primary else None, workdir / "profile"
    self.python = python

  def before(self, step: int) -> None:
    if self.window and step == self.window[0]:
      # Beside XProf's xplane.pb, a Perfetto trace (perfetto_trace.json.gz) that ui.perfetto.dev opens in
      # a browser with nothing installed. JAX's Python tracer (every Python call) only if asked: on a CPU
      # it made one smoke step's trace 30 MB instead of 0.8 MB and took 13 s to write instead of 0.5 s.
      options = jax.profiler.ProfileOptions()
      options.python_tracer_level = int(self.python)
      jax.profiler.start_trace(str(self.path), create_perfetto_trace=True, profiler_options=options)

  def after(self, step: int, state) -> None:
    if self.window and step == self.window[1]:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      say(f"\n[train] profiled steps {self.window[0] + 1}-{self.window[1]}: {self.path}/plugins/profile/"
          f"<time>/: perfetto_trace.json.gz opens at https://ui.perfetto.dev; the *.xplane.pb in XProf "
          f"(pip install xprof; xprof --logdir {self.path}) (docs/accelerators.md)")


class _Padding:
  """The share of a log interval's batch slots that hold padding, target and source side, and the target
  slots of a step (its nominal size, padding included, beside train/tgt_tokens_per_batch, the real ones)."""

  def __init__(self):
    self.slots, self.real, self.batches = np.zeros(2), np.zeros(2), 0

  def add(self, batch) -> None:
    self.batches += 1
    for i, key in enumerate(("tgt_segments", "src_segments")):
      self.slots[i] += batch[key].size
      self.real[i] += np.count_nonzero(batch[key])

  def report(self) -> dict:
    share = 1.0 - self.real / np.maximum(self.slots, 1)
    # Every process holds batches of one shape: the step's slots are this process's times their number.
    slots = float(self.slots[0] * jax.process_count() / max(self.batches, 1))
    self.slots, self.real, self.batches = np.zeros(2), np.zeros(2), 0
    return {"train/padding": float(share[0]), "train/src_padding": float(share[1]),
            "train/tgt_slots_per_batch": slots}

"""Where a run's time goes (train/goodput.py), and the trainer's switches for accelerators: the dropout
PRNG (config.train.rng_impl), a profiler window (config.train.profile_steps), the padding share."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from run import metrics as metrics_io
from run.user_errors import UserError
from test_train import comparable, smoke_config
from train import goodput
from train.train import train_and_evaluate


def _timed(seconds, *then):
  """Sleeps `seconds` and runs `then`; returns how long that took, measured inside the caller's part."""
  start = time.perf_counter()
  time.sleep(seconds)
  for call in then:
    call()
  return time.perf_counter() - start


def test_every_second_lands_in_one_part_and_compilation_is_taken_out_of_its_part():
  """Each part's seconds lie between the block's own time measured inside the part and measured around it:
  bounds that hold by construction on a machine of any speed or load (a sleep may oversleep)."""
  def compile_one():   # a program compiled inside the eval
    fresh = jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())
    fresh(jnp.arange(float(np.random.default_rng().integers(5, 10_000)))).block_until_ready()

  inner, outer = {}, {}
  start = time.perf_counter()
  clock = goodput.Goodput()
  for name, seconds, then in (("input", 0.05, ()), (None, 0.10, ()), ("eval", 0.05, (compile_one,)),
                              ("checkpoint", 0.02, ())):
    around = time.perf_counter()
    if name is None:                                   # outside every part: step time
      inner["step"] = _timed(seconds)
    else:
      with clock.part(name):
        inner[name] = _timed(seconds, *then)
    outer[name or "step"] = time.perf_counter() - around
  split = clock.close_interval()
  wall = time.perf_counter() - start
  assert sum(inner.values()) <= sum(split.values()) <= wall, (split, inner, wall)   # the parts sum to its wall
  assert 0 < split["compile"] <= inner["eval"]
  for name in ("input", "checkpoint"):
    assert inner[name] <= split[name] <= outer[name], (name, split, inner, outer)
  # The eval's seconds less its compilation: at least its sleep, and with the compilation, its whole block.
  assert 0.05 <= split["eval"] and inner["eval"] <= split["eval"] + split["compile"] <= outer["eval"]
  # Step: the rest of the wall-clock, so at least the sleep outside every part, and none of the parts' time.
  assert inner["step"] <= split["step"] <= wall - inner["input"] - inner["eval"] - inner["checkpoint"]
  assert clock.close_interval()["input"] == 0.0 and clock.total["input"] == split["input"]
  with pytest.raises(ValueError, match="part 'step'"):
    with clock.part("step"):
      pass


def test_the_summary_says_what_compilation_was():
  """Compilation split into tracing, lowering, cache reads and XLA's compilation, which sum to it."""
  clock = goodput.Goodput()
  fresh = jax.jit(lambda x: jnp.cos(x) * 2.0 - x.sum())   # a new program: traced, lowered, compiled
  fresh(jnp.arange(float(np.random.default_rng().integers(5, 10_000)))).block_until_ready()
  clock.close_interval()
  kinds = clock.compile_split()
  assert list(kinds) == list(goodput.COMPILE_KINDS)
  assert kinds["tracing"] > 0 and kinds["lowering"] > 0 and kinds["cache reads"] + kinds["backend compile"] > 0
  assert sum(kinds.values()) == pytest.approx(clock.total["compile"], abs=1e-6)
  assert "[tracing " in clock.summary() and ", backend compile " in clock.summary()


def test_the_log_lines_split_their_time_and_count_throughput_over_step_time(tmp_path):
  config = smoke_config(**{"train.num_steps": 4, "train.log_every": 2, "train.eval_every": 2})
  start = time.perf_counter()
  outcome = train_and_evaluate(config, tmp_path)
  wall = time.perf_counter() - start
  lines = [line for line in metrics_io.read_metrics(tmp_path) if "train/loss" in line]
  for line in lines:
    parts = [line[f"time/{p}_s"] for p in goodput.PARTS]
    assert line["time/wall_s"] == pytest.approx(sum(parts))
    assert line["train/tokens_per_sec"] == pytest.approx(line["train/tokens"] / line["time/step_s"], rel=1e-6)
    assert 0.0 <= line["train/padding"] < 1.0 and 0.0 <= line["train/src_padding"] < 1.0
  assert lines[0]["time/compile_s"] > 0           # the first interval compiled the step
  assert sum(outcome.time.values()) <= wall and outcome.time["eval"] > 0 and outcome.time["checkpoint"] > 0


def test_rbg_dropout_is_deterministic_and_a_resume_cannot_switch_the_prng(tmp_path):
  overrides = {"train.num_steps": 2, "train.log_every": 1, "train.rng_impl": "rbg",
               "train.profile_steps": "0-1"}
  train_and_evaluate(smoke_config(**overrides), tmp_path / "a")
  # The second run traces no profile (a profiler session costs more than the two steps): the metrics are
  # the same with and without one.
  train_and_evaluate(smoke_config(**{**overrides, "train.profile_steps": ""}), tmp_path / "b")
  a, b = (comparable(metrics_io.read_metrics(tmp_path / d)) for d in "ab")
  assert a == b
  assert not (tmp_path / "b" / "profile").exists()
  assert list((tmp_path / "a" / "profile").rglob("*.xplane.pb")), "profile_steps wrote no trace"
  assert list((tmp_path / "a" / "profile").rglob("perfetto_trace.json.gz")), "no trace that Perfetto opens"
  with pytest.raises(UserError, match="rng_impl='threefry'.*'rbg' dropout key"):
    train_and_evaluate(smoke_config(**{**overrides, "train.num_steps": 4, "train.rng_impl": "threefry"}),
                       tmp_path / "a")
  with pytest.raises(UserError, match="rng_impl='philox' is not one of"):
    train_and_evaluate(smoke_config(**{**overrides, "train.rng_impl": "philox"}), tmp_path / "c")
  with pytest.raises(UserError, match="profile_steps='5'"):
    train_and_evaluate(smoke_config(**{**overrides, "train.profile_steps": "5"}), tmp_path / "d")


@pytest.mark.parametrize("python", [False, True])
def test_the_python_tracer_is_on_only_when_asked(tmp_path, monkeypatch, python):
  # The profile of test_rbg_... above ran with the default (off); here the switch must reach the profiler.
  from train.train import _Profiler
  started = []
  monkeypatch.setattr(jax.profiler, "start_trace",
                      lambda path, create_perfetto_trace, profiler_options: started.append(profiler_options))
  profiler = _Profiler("3-5", tmp_path, primary=True, python=python)
  profiler.before(2)
  assert started == []
  profiler.before(3)
  assert [o.python_tracer_level for o in started] == [int(python)]

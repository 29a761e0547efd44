"""Every experiment file loads for each of its args, locked; any key can be overridden on the command
line and a misspelled one is an error; the paper's settings are what PAPER.md says; every smoke variant
trains two steps.
"""
import importlib.util
import math
import pathlib

import ml_collections
import pytest

from model import TransformerConfig
import run
import experiments
from data.sources import resolved_source
from run import metrics as metrics_io
from train.flops import num_params
from train.train import train_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent
# experiments/_family.py and __init__.py are helpers, not experiments.
FILES = sorted(p for p in (ROOT / "experiments").glob("*.py") if not p.name.startswith("_"))
# Files whose every key must be overridable from the command line (default.py's d_k/d_v are plain None).
TYPED = ("wmt14_ende", "wmt14_enfr", "table3")
QUIET = {"train.test_bleu": False, "train.bleu_every": 0, "train.progress": False,
         "train.tensorboard": False, "train.eval_every": 0, "train.dev_sentences": 8, "train.num_steps": 2}


def _module(path):
  spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _args(path):
  return tuple(getattr(_module(path), "ARGS", (None, "smoke")))   # default.py: '' and 'smoke'


def _leaves(config, prefix=""):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _parse_flags(spec, *overrides):
  """Parses a command line the way train/__main__.py does; returns the ConfigDict."""
  config = experiments.load_experiment(spec)
  return experiments.apply_overrides(config, [o.removeprefix("--config.") for o in overrides])


# ------------------------------------------------------------------------------------------------------
def test_the_experiments_are_there():
  assert {p.stem for p in FILES} >= {"default", "wmt14_ende", "wmt14_enfr", "table3", "lm", "variants",
                                     "decoder_only_mt", "mlm"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_arg_loads_locked_and_unknown_args_fail(path):
  args = _args(path)
  assert "smoke" in args, f"{path.name}: every experiment has a smoke variant"
  for arg in args:
    spec = f"{path}:{arg}" if arg else str(path)
    config = experiments.load_experiment(spec)
    for section in ("model", "compute", "data", "train", "decode"):
      assert section in config, (spec, section)
    run.model_config(config, 100)   # the model and compute sections are valid
    with pytest.raises((AttributeError, KeyError)):
      config.train.num_stepz = 1                                   # locked: no new keys
  with pytest.raises(ValueError, match="unknown arg"):
    _module(path).get_config("no_such_arg")


@pytest.mark.parametrize("name", TYPED)
def test_every_key_overrides_from_the_command_line(name):
  spec = f"{ROOT / 'experiments' / name}.py:smoke"
  base = experiments.load_experiment(spec)
  overrides, expected = [], {}
  for key, value in _leaves(base):
    new = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v + 0.5,
           str: lambda v: v + "x", type(None): lambda v: 16}[type(value)](value)
    if key == "compute.matmul_dtype":   # the one str-typed None (the others, d_k and d_v, are ints)
      new = "bfloat16"
    overrides.append(f"--config.{key}={new}")
    expected[key] = new
  config = _parse_flags(spec, *overrides)
  got = dict(_leaves(config))
  for key, value in expected.items():
    assert got[key] == value, key
  # A misspelled key is an error on the command line and in experiments.apply_overrides.
  with pytest.raises(Exception, match="num_encoder_layerz"):
    _parse_flags(spec, "--config.model.num_encoder_layerz=4")
  with pytest.raises(KeyError, match="num_encoder_layerz"):
    experiments.apply_overrides(base, {"model.num_encoder_layerz": 4})


def test_the_paper_settings():
  """The numbers in PAPER.md's "Training and decoding setup"."""
  ende = {arg: experiments.load_experiment(f"{ROOT}/experiments/wmt14_ende.py:{arg}") for arg in ("base", "big")}
  enfr = {arg: experiments.load_experiment(f"{ROOT}/experiments/wmt14_enfr.py:{arg}") for arg in ("base", "big")}
  for c in (*ende.values(), *enfr.values()):
    assert c.data.source == "tfds" and c.data.src_lang == "en" and c.data.batch_tokens == 25_000
    assert (c.train.schedule, c.train.warmup_steps, c.train.label_smoothing) == ("paper", 4000, 0.1)
    assert (c.train.adam_b1, c.train.adam_b2, c.train.adam_eps) == (0.9, 0.98, 1e-9)
    assert c.train.checkpoint_every_minutes == 10.0
    assert (c.decode.beam_size, c.decode.alpha, c.decode.max_extra_len) == (4, 0.6, 50)
  for c in ende.values():
    assert (c.data.tfds_name, c.data.tgt_lang, c.data.vocab_size) == ("wmt14_translate/de-en", "de", 37_000)
  for c in enfr.values():
    assert (c.data.tfds_name, c.data.tgt_lang, c.data.vocab_size) == ("wmt14_translate/fr-en", "fr", 32_000)
  for langs in (ende, enfr):
    base, big = langs["base"], langs["big"]
    assert (base.model.d_model, base.model.d_ff, base.model.num_heads, base.model.num_encoder_layers,
            base.model.dropout_rate) == (512, 2048, 8, 6, 0.1)
    assert (big.model.d_model, big.model.d_ff, big.model.num_heads) == (1024, 4096, 16)
    assert (base.train.num_steps, big.train.num_steps) == (100_000, 300_000)
    assert (base.train.average_last, big.train.average_last) == (5, 20)   # the paper's reported models
    # ... 10 minutes apart at 0.4 s (base) and 1.0 s (big) a step: step checkpoints 1,500 and 600 apart
    assert (base.train.average_every_steps, big.train.average_every_steps) == (1500, 600)
    assert base.data.source_eos and big.data.source_eos and not base.data.pack
  assert ende["big"].model.dropout_rate == 0.3 and enfr["big"].model.dropout_rate == 0.1


def test_table3_declares_every_row_with_the_papers_numbers():
  path = ROOT / "experiments" / "table3.py"
  module = _module(path)
  trials = []
  module.sweep(lambda name, **overrides: trials.append((name, overrides)))
  names = [name for name, _ in trials]
  assert len(names) == len(set(names)) == 20 and set(names) == set(module.PAPER)
  for name, overrides in trials:
    config = experiments.apply_overrides(experiments.load_experiment(str(path)), overrides)
    count = num_params(TransformerConfig(vocab_size=37_000, **config.model.to_dict()))
    published = module.PAPER[name]["params_m"]
    if published:   # PAPER.md: exact counts are within ~7% of the rounded published ones
      assert abs(count / 1e6 - published) / published < 0.08, (name, count, published)
  changed = dict(trials)
  assert changed["A_h1"] == {"model.num_heads": 1, "model.d_k": 512, "model.d_v": 512}
  assert changed["B_dk16"]["model.d_v"] == 64
  assert changed["D_ls0.2"] == {"train.label_smoothing": 0.2}
  assert changed["big"]["train.num_steps"] == 300_000 and changed["big"]["model.dropout_rate"] == 0.3
  smoke = []
  module.sweep(lambda name, **overrides: smoke.append(name), "smoke")
  assert len(smoke) == 2


def _params(spec, overrides=()):
  config = experiments.apply_overrides(experiments.load_experiment(str(ROOT / "experiments" / spec)), overrides)
  return num_params(TransformerConfig(vocab_size=config.data.vocab_size, **config.model.to_dict()))


def test_the_family_experiments_match_the_defaults_parameter_count():
  default = _params("default.py")
  assert default == 1_949_696
  assert _params("decoder_only_mt.py") == 2_015_616 and _params("mlm.py") == 1_841_856
  assert _params("decoder_only_mt.py:paper") == 2_015_360   # post-norm: no final LayerNorm
  for name in ("decoder_only_mt", "mlm", "lm"):
    assert abs(_params(f"{name}.py") / default - 1) < 0.07, name
  tasks = {name: experiments.load_experiment(str(ROOT / "experiments" / f"{name}.py")).data.task
           for name in ("decoder_only_mt", "mlm", "lm", "variants")}
  assert tasks == {"decoder_only_mt": "decoder_only_mt", "mlm": "mlm", "lm": "lm", "variants": "translation"}


def test_variants_varies_one_switch_at_a_time_and_keeps_the_grid():
  path = ROOT / "experiments" / "variants.py"
  module = _module(path)
  for arg, count in ((None, 11), ("grid", 60), ("smoke", 1)):
    trials = []
    module.sweep(lambda name, **overrides: trials.append((name, overrides)), arg)
    assert len(trials) == len({name for name, _ in trials}) == count, arg
    spec = f"{path}:{arg}" if arg else str(path)
    for name, overrides in trials:   # every trial is a valid model
      config = experiments.apply_overrides(experiments.load_experiment(spec), overrides)
      TransformerConfig(vocab_size=100, **config.model.to_dict())
    if arg is None:
      assert trials[0] == ("base", {})
      assert all(len(overrides) == 1 for _, overrides in trials[1:])   # one switch from the default
      switched = sorted(str(value) for _, overrides in trials for value in overrides.values())
      assert switched == sorted(["learned", "rope", "alibi", "relative", "2", "1", "gelu", "swiglu", "geglu",
                                 "rmsnorm"])
  base = experiments.load_experiment(str(path))
  assert _params("variants.py") == _params("default.py")   # base is the default experiment's model
  assert base.model.arch == "encoder_decoder" and base.model.num_kv_heads is None


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_smoke_variant_trains_two_steps(path, tmp_path):
  config = experiments.apply_overrides(experiments.load_experiment(f"{path}:smoke"), QUIET)
  # Offline on the embedded corpus (wmt14_ende's reads prepared WMT only given config.data.tfds_data_dir).
  assert resolved_source(config.data) == "synthetic", "smoke variants run offline on the embedded corpus"
  outcome = train_and_evaluate(config, tmp_path)
  assert outcome.step == 2 and outcome.interrupted is None
  losses = [line["train/loss"] for line in metrics_io.read_metrics(tmp_path) if "train/loss" in line]
  assert losses and all(math.isfinite(loss) for loss in losses)
  assert math.isfinite(outcome.eval["eval/loss"])


def test_small_corpus_dtype_is_its_argument_and_keeps_the_budget():
  module = _module(ROOT / "experiments" / "small_corpus.py")
  bf16, plain = module.get_config("bf16"), module.get_config()
  assert bf16.compute.matmul_dtype == "bfloat16" and plain.compute.matmul_dtype is None
  assert module.get_config("smoke").compute.matmul_dtype is None
  # The same wall-clock: float32 steps run 1/BF16_SPEEDUP as fast, so there are that many fewer.
  assert bf16.train.num_steps == module.STEPS_BF16
  assert abs(plain.train.num_steps * module.BF16_SPEEDUP - module.STEPS_BF16) < 10
  for config in (bf16, plain):   # the tuned recipe (docs/small_corpus.md)
    assert config.model.pre_norm and config.model.dropout_rate == 0.0
    assert config.train.learning_rate == 8e-3 and config.train.average_last == 5
    assert config.data.source_eos and config.decode.alpha == 1.0
    # 12,000 pieces at 35k and at 75k pairs: the size that won on both corpora, not data.vocab's rule by
    # corpus size (8,000 at 35k pairs: 1.3 test BLEU less on the Romanian corpus).
    assert config.data.vocab_size == module.VOCAB_SIZE == 12_000
    assert config.train.weight_decay == module.WEIGHT_DECAY == 0.2   # no dropout: decay is the regularizer
    assert config.data.max_len == 0   # from the corpus (data/max_len.py)
    TransformerConfig(vocab_size=12_000, **config.model.to_dict())   # a valid model config


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_no_experiment_reads_the_machine(path, monkeypatch):
  """An experiment's config is a function of its file and argument: the same on every CPU, so that a run
  resumes on another machine with the config it started with."""
  import builtins
  import platform
  real_open = builtins.open

  def guarded_open(file, *args, **kwargs):
    assert not str(file).startswith(("/proc", "/sys")), f"{path.name} reads {file}"
    return real_open(file, *args, **kwargs)

  def no_probe(*_):
    raise AssertionError(f"{path.name} probes the machine")

  monkeypatch.setattr(builtins, "open", guarded_open)
  monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: guarded_open(self, *a, **k).read())
  for name in ("processor", "machine", "platform"):
    monkeypatch.setattr(platform, name, no_probe)
  monkeypatch.setattr("os.cpu_count", no_probe)
  module = _module(path)
  for arg in _args(path):
    try:
      first = module.get_config(arg)
    except FileNotFoundError:   # a variant that needs a corpus not built here (table3.py:cpu)
      continue
    assert first.to_json() == module.get_config(arg).to_json()


def test_auto_vocab_size_grows_with_the_corpus_within_bounds():
  from data.vocab import auto_vocab_size
  assert auto_vocab_size(74_707) == 12_000      # the corpus it was tuned on
  assert auto_vocab_size(28_000) == 7_500
  assert auto_vocab_size(100) == 1_000 and auto_vocab_size(10_000_000) == 32_000
  sizes = [auto_vocab_size(n) for n in (5_000, 20_000, 80_000, 320_000)]
  assert sizes == sorted(sizes) and all(size % 500 == 0 for size in sizes)

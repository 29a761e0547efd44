"""Fast paths beside the plain model: same results as model/ and train/loss.py, laid out for one compiler.
Each module holds one fast path and knows nothing about the Transformer. model/ops.py is the one module
of model/ that reaches them (tests/test_imports.py holds it to that), through two:

  cpu_backend      what Compute.kernels="cpu" plugs in, for every pass (`layer_ops`) and for
                   decoding (`decoding`): the modules below, which nothing else in model/ names
  fused_attention  cuDNN's and Pallas splash's fused attention for the teacher-forced passes, chosen by
                   Compute.attention_impl

For every pass on a CPU (cpu_backend.layer_ops):

  mixed_matmul   bfloat16-operand matmuls with float32 accumulation, custom gradient (mixed precision)
  flat_matmul    float32 dense layers with several contracted or output axes as one 2-D matmul
  dropout16      dropout drawing 16 random bits per element instead of 32

The CPU decoding backend, which only decoding on a CPU uses (cpu_backend.decoding):

  decode_cache   head-major decoding caches stored in the matmul dtype, and beam-slot caches that beam
                 search never copies
  output_layer   the pre-softmax weights (and, in float32, the decoder's kernels) laid out once per set
                 of parameters for decoding, as panels for the C++ product
  cpu_decoding   the decoding step's attention, panel products and beam search's choice of candidates,
                 as C++ custom calls (built on first use; in a program lowered for another platform, the
                 XLA ops that compute the same)
  beam_top_k     beam search's top-k over every extension, pruned by chunks (where the C++ did not build)

One module is not a layer's piece but a setting of the process, called by `python -m train` before it
imports JAX:

  host_memory    glibc's malloc set to keep the buffers XLA:CPU frees after each step

Every CPU one was measured faster on XLA:CPU only (docs/performance.md); on GPU and TPU their optimization
barriers and layouts would block fusion, so "auto" picks the reference there.
"""
from __future__ import annotations

import contextlib
import functools
import types

CHOICES = ("auto", "reference", "cpu")
# The paper's model, the one base a fast path's declaration may start from ({model.TransformerConfig
# field: None for any value}): its sizes, P_drop, dtypes and how it is computed. Read-only, so that no
# fast path can declare a field for another by writing here.
PAPER = types.MappingProxyType({name: None for name in (
    "vocab_size", "d_model", "d_ff", "num_heads", "d_k", "d_v", "num_encoder_layers", "num_decoder_layers",
    "dropout_rate", "max_len", "param_dtype", "layer_norm_epsilon", "compute")})


def declare(*any_value: str, **values) -> dict:
  """What one fast path implements, in the form model.config.unimplemented reads: the paper's model
  (PAPER), the fields named in any_value in every value, and each field of `values` in the values it
  takes (a tuple) or where a predicate of the config holds. A new dict on every call, so each fast path
  holds its own: declaring a field for one declares it for no other. A field that no declaration names,
  a switch added tomorrow included, sends that fast path to the plain model."""
  return {**PAPER, **{name: None for name in any_value}, **values}


# The logit of a key a query may not see, in every XLA attention (model/attention.py, decode_cache.py):
# large enough to zero a float32 softmax entry, small enough not to overflow when added to logits.
MASKED = -1e9


def resolve(kernels: str) -> str:
  """'auto' -> 'cpu' when JAX's default backend is the CPU, else 'reference'; the others unchanged.

  For what is chosen before anything is traced (decoding's cache layout). The train and eval steps
  resolve 'auto' where their program is lowered instead (`on_lowering_platform`)."""
  if kernels not in CHOICES:
    raise ValueError(f"kernels={kernels!r} is not one of {list(CHOICES)}")
  if kernels == "auto":
    import jax   # here, not at the top: kernels.host_memory must be importable before JAX is
    return "cpu" if jax.default_backend() == "cpu" else "reference"
  return kernels


def on_lowering_platform(fn, cfg, *args):
  """fn(cfg, *args), with cfg.compute.kernels="auto" resolved by the platform the program is lowered for
  (a model.TransformerConfig): "cpu" for the CPU, "reference" for any other platform, chosen by
  `platform_dependent` below: a plain jit traces one of them, an export for other platforms both. args are
  passed through as arguments: a branch must close over no arrays (jax.export)."""
  if cfg.compute.kernels != "auto":
    return fn(cfg, *args)
  branch = lambda kernels: functools.partial(fn, cfg.with_compute(kernels=kernels))
  return platform_dependent(*args, cpu=branch("cpu"), default=branch("reference"))


def platform_dependent(*args, default, **branches):
  """jax.lax.platform_dependent(*args, default=default, **branches) (branches named by PLATFORMS), tracing
  only the branch of the platform the program is lowered for wherever that is known.

  A plain jit runs where this process's JAX puts it (its default device, else its default backend), so
  only that platform's branch is traced. Inside `lowering_for(platforms)` (what `export` enters), for
  platforms other than that one or for several, every branch is traced under jax.lax.platform_dependent
  and lowering keeps each platform's own: a step exported from a CPU host for "cuda" is the step a GPU
  host traces."""
  import jax   # here, not at the top: kernels.host_memory must be importable before JAX is
  if set(branches) - set(PLATFORMS):
    raise ValueError(f"platform_dependent: branches {sorted(branches)}; name each by one of {list(PLATFORMS)}")
  host = _host_platform()
  platforms = _LOWERING[0].value if _LOWERING else None
  if platforms is None or platforms == (host,):
    return branches.get(host, default)(*args)
  return jax.lax.platform_dependent(*args, default=default, **branches)


# jax.export's names of the platforms a program can be lowered for
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# lowering_for's jax.make_user_context, made on its first use: a jit cache key, so that a function traced
# inside lowering_for is traced again outside it (and the other way round). Made before any export traces
# and never by a plain trace, so a run that exports nothing keys its jits as before (no retrace).
_LOWERING = []


def _host_platform() -> str:
  """The platform a plain jit runs on here, in jax.export's names ("cuda", not "gpu"): the default
  device's where one is set, else the default backend's. (A jit placed on another backend's devices runs
  the branch of the default one: on a GPU host, the reference on CPU devices, which is correct there.)"""
  import jax
  from jax import export as jax_export
  device = jax.config.jax_default_device
  return "cpu" if getattr(device, "platform", device) == "cpu" else jax_export.default_export_platform()


@contextlib.contextmanager
def lowering_for(platforms):
  """Within: the programs traced are lowered for `platforms` (PLATFORMS' names), not for this host's
  platform; on_lowering_platform keeps every one's branch. What exports a program for another machine
  enters it (`export` does): outside it, a choice made while tracing follows this host."""
  platforms = tuple(platforms)
  if not platforms or set(platforms) - set(PLATFORMS):
    raise ValueError(f"lowering_for({platforms!r}): name one or more of {list(PLATFORMS)}")
  if not _LOWERING:
    import jax
    _LOWERING.append(jax.make_user_context(None))
  with _LOWERING[0](platforms):
    yield


def export(fn, *args, platforms, custom_calls=(), **options):
  """jax.export.export(fn, platforms=platforms, **options)(*args), traced inside lowering_for(platforms):
  how this code base exports a jitted function for other machines (tests/test_lowering.py holds every
  export to it). custom_calls: targets the program may call besides those jax.export knows to be stable
  (the C++ decoding kernels'). Returns the jax.export.Exported."""
  from jax import export as jax_export
  checks = [*options.pop("disabled_checks", ()),
            *(jax_export.DisabledSafetyCheck.custom_call(name) for name in custom_calls)]
  with lowering_for(platforms):
    return jax_export.export(fn, platforms=platforms, disabled_checks=checks, **options)(*args)

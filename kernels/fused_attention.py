"""Fused attention kernels beside the plain attention of model/attention.py, chosen by
Compute.attention_impl (docs/accelerators.md, "Attention implementations"), plugged into
model/attention.py by model/ops.py:

  xla     model/attention.dot_product_attention, as the paper writes it (every platform)
  cudnn   jax.nn.dot_product_attention(implementation="cudnn"): cuDNN's flash attention (NVIDIA GPUs)
  splash  Pallas TPU splash attention with segment ids, for packed batches (TPUs; on a CPU the same
          kernel runs in Pallas interpret mode, slowly, which is how tests check it)
  auto    cudnn on a GPU, splash on a TPU, xla on a CPU, decided by the platform the program is lowered
          for (kernels.platform_dependent), not by the machine that traces it: a plain jit traces its own
          platform's branch only; a train step exported from a CPU host for ("cuda", "tpu") carries
          cuDNN's and splash's kernels.

The kernels serve the teacher-forced passes (training, evaluation, the encoder), whose masks come from
segment ids (PackedMask): they read the segment ids and the causal flag, not the dense mask that
model/attention.py's `visible` builds, so each takes only the configs it declares (CUDNN, SPLASH: every
field of today's family, in its values; model/ops.py's attention_impl sends any other to xla, naming
the kernel and the field). A decoding step attends one query to the cache with the plain attention. Where a kernel cannot
take what the model asks for (a score bias for splash, attention dropout, float32 for cuDNN), that
attention uses the plain one and says why once (logging, warning level where the kernel was asked for
or would run). Splash computes whole blocks of 128 positions: a
length that is not a multiple is padded up to one where that at most doubles it (SPLASH_PAD_LIMIT), and
falls back otherwise.
"""
from __future__ import annotations

import logging
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

import kernels

# What each kernel implements, its own declaration (kernels.declare): a config with another field set
# computes that kernel's attentions as model/ does (model/ops.py's attention_impl). Both read the segment
# ids and the causal flag, never the dense mask, and compute softmax(q k^T / sqrt(d_k)) themselves: a
# switch that changes what a query sees or its scores is not theirs until declared here with a test.
# (Attention dropout, score biases and dtypes they refuse per call: *_unsupported below.)
CUDNN = kernels.declare(
    "attention_dropout_rate", "relu_dropout_rate", "pre_norm", "share_embeddings", "attention_bias",
    "num_kv_heads", "logits_bias", "relative_buckets", "relative_max_distance", "num_classes",
    arch=("encoder_decoder", "decoder_only", "encoder_only"),
    positions=("sinusoidal", "learned", "rope", "alibi", "relative"),
    activation=("relu", "gelu", "swish", "swiglu", "geglu"), norm=("layernorm", "rmsnorm"))
SPLASH = kernels.declare(
    "attention_dropout_rate", "relu_dropout_rate", "pre_norm", "share_embeddings", "attention_bias",
    "num_kv_heads", "logits_bias", "relative_buckets", "relative_max_distance", "num_classes",
    arch=("encoder_decoder", "decoder_only", "encoder_only"),
    positions=("sinusoidal", "learned", "rope", "alibi", "relative"),
    activation=("relu", "gelu", "swish", "swiglu", "geglu"), norm=("layernorm", "rmsnorm"))
KERNELS = {"cudnn": CUDNN, "splash": SPLASH}   # Compute.attention_impl's kernels, by name
log = logging.getLogger(__name__)
_SAID: set = set()
SPLASH_BLOCKS = (512, 256, 128)   # splash's block sizes, largest first: a length must be a multiple of one
# How much longer than the batch's length splash may compute. A padded length L' costs splash (L'/L)^2
# times the scores; the plain attention computes L^2 scores but writes them to memory and reads them back
# several times, forward and backward, where splash keeps them on chip. Our estimate of that advantage,
# from the TPU's flops per byte, is about 10x per score, so padding that at most doubles a length (4x the
# scores) is taken; a TPU's measurement should set this constant (docs/accelerators.md).
SPLASH_PAD_LIMIT = 2.0


@flax.struct.dataclass
class PackedMask:
  """The mask of a teacher-forced pass (model.attention.packed_mask) with what it was built from, so that a
  fused kernel can read the segment ids where the plain attention reads the dense mask.

  dense: bool [b, 1, q_len, kv_len]; q_segments int [b, q_len], kv_segments int [b, kv_len]; causal:
  whether a query also sees no later key; packed: whether a row may hold several sequences (False: one
  sequence a row, its tokens first and padding after, so that lengths describe the mask)."""
  dense: jax.Array
  q_segments: jax.Array
  kv_segments: jax.Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  packed: bool = flax.struct.field(pytree_node=False, default=True)

  def lengths(self):
    """Unpacked rows: (query lengths, key lengths) int32 [b], at least 1 (an empty row attends to its
    first position, so that nothing divides by zero)."""
    count = lambda segments: jnp.maximum(jnp.sum(segments != 0, axis=1), 1).astype(jnp.int32)
    return count(self.q_segments), count(self.kv_segments)


def splash_length(length: int) -> int | None:
  """The length splash computes a `length`-position axis at (a multiple of its smallest block), or None
  where padding to it would cost more than the plain attention."""
  block = SPLASH_BLOCKS[-1]
  padded = -(-length // block) * block
  return padded if padded <= SPLASH_PAD_LIMIT * length else None


def _say(impl: str, why: str, loud: bool) -> None:
  """Logs once per process that `impl` is not used for an attention, and why."""
  message = f"attention_impl={impl!r}: {why}; that attention uses XLA's (model/attention.py)"
  if message not in _SAID:
    _SAID.add(message)
    log.log(logging.WARNING if loud else logging.INFO, message)


def cudnn_unsupported(q, k, v, bias, dropout: bool) -> str | None:
  """Why cuDNN's fused attention cannot compute this attention (None: it can)."""
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN's flash attention takes bfloat16 or float16, and this model computes in {jnp.dtype(q.dtype)}"
  if dropout:
    return "attention dropout (attention_dropout_rate > 0) is not in jax.nn.dot_product_attention"
  if q.shape[-1] != v.shape[-1] or q.shape[-1] % 8 or q.shape[-1] > 128:
    return f"cuDNN needs d_k = d_v, a multiple of 8 up to 128 (d_k={q.shape[-1]}, d_v={v.shape[-1]})"
  return None


def splash_unsupported(q, k, v, bias, dropout: bool) -> str | None:
  """Why splash attention cannot compute this attention (None: it can)."""
  if bias is not None:
    return "splash attention adds no score bias (positions='alibi' or positions='relative')"
  if dropout:
    return "splash attention has no attention dropout (attention_dropout_rate > 0)"
  if q.shape[-1] != v.shape[-1]:
    return f"splash attention needs d_k = d_v (d_k={q.shape[-1]}, d_v={v.shape[-1]})"
  for name, length in (("query", q.shape[1]), ("key", k.shape[1])):
    if splash_length(length) is None:
      return (f"the {name} length {length} is not a multiple of {SPLASH_BLOCKS[-1]} (splash's blocks), and "
              f"padding it to {-(-length // SPLASH_BLOCKS[-1]) * SPLASH_BLOCKS[-1]} costs more than "
              f"falling back (SPLASH_PAD_LIMIT={SPLASH_PAD_LIMIT})")
  return None


def cudnn(q, k, v, mask, bias):
  """cuDNN's flash attention. q [b, q_len, h, d]; k, v [b, kv_len, g, d] (g divides h); mask: a
  PackedMask; bias None or [b, h, q_len, kv_len]. Returns [b, q_len, h, d] in q's dtype.
  Traces only where jax's CUDA plugin is installed (RuntimeError 'cuDNN is not detected' elsewhere).

  With one sequence a row (mask.packed False) and no score bias, the mask goes to cuDNN as what it is:
  the rows' lengths and, for the decoder's self-attention, the causal mask type. cuDNN then reads no
  [b, 1, q_len, kv_len] array, skips the blocks above the diagonal, and its backward pass computes no
  bias gradient. A packed batch's segments, or a bias, go as a dense mask (jax turns it into a bias)."""
  if bias is None and not mask.packed:
    q_lengths, kv_lengths = mask.lengths()
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, query_seq_lengths=q_lengths,
                                        key_value_seq_lengths=kv_lengths, implementation="cudnn")
  bias = None if bias is None else bias.astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask.dense, implementation="cudnn")


def _splash_kernel(heads: int, q_len: int, kv_len: int, causal: bool, interpret: bool):
  block = lambda n: next(s for s in SPLASH_BLOCKS if n % s == 0)
  bq, bkv = block(q_len), block(kv_len)
  sizes = splash_kernel.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                                   block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  shape = (q_len, kv_len)
  one = splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)
  return splash_kernel.make_splash_mha(splash_mask.MultiHeadMask([one] * heads), block_sizes=sizes,
                                       head_shards=1, q_seq_shards=1, interpret=interpret)


def splash(q, k, v, mask, interpret: bool = False):
  """Pallas TPU splash attention with the mask's segment ids (a packed batch's sentences see only
  themselves; padding, segment 0, sees padding). q [b, q_len, h, d]; k, v [b, kv_len, g, d]; mask: a
  PackedMask. Returns [b, q_len, h, d] in q's dtype. interpret: Pallas interpret mode (any
  platform, slow). A length that is not a multiple of splash's blocks is padded up to splash_length(),
  the padding as segment 0; its outputs are cut off."""
  b, q_len, h, d = q.shape
  if k.shape[2] != h:   # grouped or multi-query: each key/value head serves h/g query heads
    k, v = jnp.repeat(k, h // k.shape[2], axis=2), jnp.repeat(v, h // k.shape[2], axis=2)
  q_pad, kv_pad = splash_length(q_len) - q_len, splash_length(k.shape[1]) - k.shape[1]
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
  q, q_segments = pad(q, q_pad), pad(mask.q_segments, q_pad)
  k, v, kv_segments = pad(k, kv_pad), pad(v, kv_pad), pad(mask.kv_segments, kv_pad)
  kernel = _splash_kernel(h, q.shape[1], k.shape[1], mask.causal, interpret)
  heads_first = lambda x: jnp.swapaxes(x, 0, 1)                              # [len, h, d] -> [h, len, d]

  def one(q, k, v, q_segments, kv_segments):
    ids = splash_kernel.SegmentIds(q=q_segments, kv=kv_segments)
    return heads_first(kernel(heads_first(q), heads_first(k), heads_first(v), segment_ids=ids))

  scaled = q * jnp.asarray(d ** -0.5, q.dtype)
  out = jax.vmap(one)(scaled, k, v, q_segments.astype(jnp.int32), kv_segments.astype(jnp.int32))
  return out[:, :q_len]


def attention(impl: str, q, k, v, mask, bias, dropout: bool, reference: Callable,
              declared: tuple = tuple(KERNELS)):
  """The attention `impl` chooses, for the teacher-forced pass. q [b, q_len, h, d_k]; k, v
  [b, kv_len, g, d]; mask: a PackedMask; bias: None or float [b, h, q_len, kv_len];
  dropout: whether the attention weights take dropout (the kernels do not). reference(q, k, v, mask,
  bias) is the plain attention; declared: the kernels whose declaration takes the model (with "auto",
  the others are not traced; model/ops.py's attention_impl gives it). Returns [b, q_len, h, d_v].

  Each branch takes everything as arguments (no closed-over arrays): jax.export's bookkeeping of a
  program's arguments breaks on arrays that a platform_dependent branch closes over."""
  if impl == "xla":
    return reference(q, k, v, mask, bias)
  cudnn_why = cudnn_unsupported(q, k, v, bias, dropout)
  splash_why = splash_unsupported(q, k, v, bias, dropout)
  backend = jax.default_backend()

  def on_tpu(q, k, v, mask, bias, interpret=False):
    try:
      return splash(q, k, v, mask, interpret=interpret)
    # a shape that this jax's splash kernel refuses (it checks when tracing; older versions, for example,
    # take head dimensions that are multiples of 128 only)
    except NotImplementedError as error:
      _say(impl, f"on a TPU, splash attention cannot be traced here ({error})", loud=backend == "tpu")
      return reference(q, k, v, mask, bias)

  args = (q, k, v, mask, bias)
  if impl == "cudnn":
    if cudnn_why:
      _say(impl, cudnn_why, loud=True)
      return reference(*args)
    return cudnn(*args)
  if impl == "splash":
    if splash_why:
      _say(impl, splash_why, loud=True)
      return reference(*args)
    # The TPU kernel where lowered for a TPU; elsewhere the same kernel in interpret mode (tests, CPU).
    return kernels.platform_dependent(
        *args, tpu=on_tpu, default=lambda *args: on_tpu(*args, interpret=True))
  # auto: each platform's kernel, where its declaration takes the model (model/ops.py said which does
  # not) and it can take this attention.
  def on_gpu(*args):
    try:
      return cudnn(*args)
    # RuntimeError: jax's CUDA plugin is not installed where this is traced; the others: a shape or
    # layout that jax's cuDNN attention refuses (it checks when tracing)
    except (RuntimeError, NotImplementedError, ValueError) as error:
      _say("auto", f"on a GPU, cuDNN's attention cannot be traced here ({error})", loud=backend == "gpu")
      return reference(*args)

  branches = {}
  if "cudnn" in declared and cudnn_why:
    _say("auto", f"on a GPU, {cudnn_why}", loud=backend == "gpu")
  elif "cudnn" in declared:
    branches["cuda"] = on_gpu
  if "splash" in declared and splash_why:
    _say("auto", f"on a TPU, {splash_why}", loud=backend == "tpu")
  elif "splash" in declared:
    branches["tpu"] = on_tpu
  if not branches:
    return reference(*args)
  return kernels.platform_dependent(*args, default=reference, **branches)

"""Attention kernels chosen by ``config.model.attention_impl``: the softmax core of the backbone.

Every attention path of the backbone (the plain ``attention`` named op, Ulysses after its
all-to-all, the Megatron sublayer on its local heads) ends in :func:`attend`, which runs the
kernel selected here. The kernels take q [B, T, H, Dh], k/v [B, S, KV, Dh] (grouped-query:
H a multiple of KV), a causal flag and optional segment ids [B, T] (packed documents, self-
attention: a query sees only keys of its own segment) and return [B, T, H, Dh]:

* ``xla``: ``jax.nn.dot_product_attention(implementation="xla")`` for ``block == 0``, the
  flash-style blockwise custom VJP of :mod:`omni_jax.models.blockwise` for ``block > 0``.
  Runs on every backend; the reference the others are tested against.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused flash
  attention (GPU; bfloat16 / float16 inputs). Segment ids go in as its ``mask`` (cuDNN adds
  it as a [B, 1, T, S] bias: T*S memory per sequence, unlike the causal-only call).
  ``block`` is unused (cuDNN tiles itself).
* ``pallas_gpu``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton flash attention
  with its Pallas backward). The kernel wants as many K/V heads as query heads, so K/V are
  repeated to H here (their gradients sum back through the repeat). ``block`` (default 128)
  is the forward tile, the backward tiles are the kernel's default 32; both shrink to a
  power of two dividing the length.
* ``pallas_tpu``: the splash attention kernel of
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (its multi-query form, one call per
  K/V head, vmapped over heads and batch), with a ``CausalMask`` / ``FullMask`` per query
  head of the group and ``SegmentIds``. Tiles are multiples of 128 (``block`` rounded, at
  most 512), so T must be a multiple of 128.

A kernel refuses to run off its backend (one error saying what to use instead); tests run
the Pallas kernels on CPU with Pallas ``interpret=True`` and the cuDNN call through its CPU
fallback, ``jax.nn.dot_product_attention(implementation="xla")`` (``CUDNN_CPU_FALLBACK``),
both by ``use_kernel(impl, interpret=True)``.

The selection is a trace-time setting (:func:`use_kernel`, a context variable like the named
ops' overrides): the backbone's blocks enter it with their spec's ``attention_impl``, so the
parallel layouts (omni_jax/parallel) that call the attention core per device pick up the same kernel
without an extra argument through every layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from omni_jax.models.blockwise import blockwise_attention, same_segment

ATTENTION_IMPLS = ("xla", "cudnn", "pallas_gpu", "pallas_tpu")
CUDNN_CPU_FALLBACK = "xla"  # jax.nn.dot_product_attention's implementation off-GPU in tests


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """The selected kernel; ``interpret``: run it on this host's CPU (Pallas ``interpret=True``,
  cuDNN through ``CUDNN_CPU_FALLBACK``) — for tests of the accelerator kernels."""
  impl: str = "xla"
  interpret: bool = False


_CHOICE: contextvars.ContextVar[KernelChoice] = contextvars.ContextVar(
    "omni_jax_attention_kernel", default=KernelChoice())  # noqa: B039 (frozen dataclass)


def check_attention_impl(impl: str) -> str:
  """``impl`` if it names a kernel, else one error listing the allowed names."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r} is not a known attention kernel; allowed: "
                     f"{', '.join(ATTENTION_IMPLS)}")
  return impl


@contextlib.contextmanager
def use_kernel(impl: str, *, interpret: bool | None = None) -> Iterator[KernelChoice]:
  """Within the block :func:`attend` runs kernel ``impl``; ``interpret=None`` keeps the
  enclosing block's setting (so a test's ``use_kernel(impl, interpret=True)`` holds through
  the model's own ``use_kernel(spec.attention_impl)``)."""
  outer = _CHOICE.get()
  choice = KernelChoice(check_attention_impl(impl),
                        outer.interpret if interpret is None else bool(interpret))
  token = _CHOICE.set(choice)
  try:
    yield choice
  finally:
    _CHOICE.reset(token)


def selected() -> KernelChoice:
  return _CHOICE.get()


def _require_backend(impl: str, platform: str, interpret: bool) -> bool:
  """True when running on ``platform``; else an error unless ``interpret`` (CPU check)."""
  backend = jax.default_backend()
  if backend == platform:
    return True
  if interpret:
    return False
  raise ValueError(f"attention_impl={impl!r} runs on a {platform.upper()} backend, but this "
                   f"process's JAX backend is {backend!r}; use attention_impl='xla' here "
                   f"(the kernel's CPU check: attention_kernels.use_kernel({impl!r}, "
                   f"interpret=True))")


def _check_self_attention(impl: str, q, k, segment_ids) -> None:
  if segment_ids is not None and (q.shape[1] != k.shape[1]
                                  or segment_ids.shape != q.shape[:2]):
    raise ValueError(f"attention_impl={impl!r}: segment ids [B, T] need self-attention "
                     f"(T == S): q {q.shape}, k {k.shape}, segment_ids {segment_ids.shape}")


def xla_attention(q, k, v, *, causal: bool, block: int = 0, segment_ids=None,
                  interpret: bool = False) -> jax.Array:
  """Dense ``jax.nn.dot_product_attention`` (``block == 0``) or blockwise flash (``> 0``)."""
  del interpret
  if block:
    return blockwise_attention(q, k, v, causal=causal, block=block, segment_ids=segment_ids)
  if segment_ids is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  return jax.nn.dot_product_attention(q, k, v, mask=same_segment(segment_ids, segment_ids),
                                      is_causal=causal)


def cudnn_attention(q, k, v, *, causal: bool, block: int = 0, segment_ids=None,
                    interpret: bool = False) -> jax.Array:
  """cuDNN flash attention on GPU; off-GPU with ``interpret`` the same call with
  ``implementation=CUDNN_CPU_FALLBACK``."""
  del block
  on_gpu = _require_backend("cudnn", "gpu", interpret)
  _check_self_attention("cudnn", q, k, segment_ids)
  if on_gpu and q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"attention_impl='cudnn' needs bfloat16 or float16 q/k/v (cuDNN flash "
                     f"attention), got {q.dtype}; set model.dtype='bfloat16'")
  mask = None if segment_ids is None else same_segment(segment_ids, segment_ids)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation="cudnn" if on_gpu else CUDNN_CPU_FALLBACK)


def _pallas_modules():
  """(gpu attention, splash kernel, splash masks) modules of ``jax.experimental.pallas.ops``."""
  # Imported only when a Pallas kernel is selected: about a second of import otherwise paid
  # by every user of the models.
  from jax.experimental.pallas.ops.gpu import attention
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel,
    splash_attention_mask,
  )
  return attention, splash_attention_kernel, splash_attention_mask


def _pow2_tile(n: int, cap: int) -> int:
  """The largest power of two <= ``cap`` dividing ``n`` (1 at worst)."""
  t = 1
  while t * 2 <= cap and n % (t * 2) == 0:
    t *= 2
  return t


def pallas_gpu_attention(q, k, v, *, causal: bool, block: int = 0, segment_ids=None,
                         interpret: bool = False) -> jax.Array:
  """Pallas' Triton flash attention (``jax.experimental.pallas.ops.gpu.attention.mha``)."""
  gpu_attention, _, _ = _pallas_modules()
  _require_backend("pallas_gpu", "gpu", interpret)
  _check_self_attention("pallas_gpu", q, k, segment_ids)
  t, h, dh = q.shape[1], q.shape[2], q.shape[3]
  s, kv = k.shape[1], k.shape[2]
  if h // kv > 1:
    k, v = jnp.repeat(k, h // kv, axis=2), jnp.repeat(v, h // kv, axis=2)
  fwd, bwd = block or 128, 32
  sizes = gpu_attention.BlockSizes(
      block_q=_pow2_tile(t, fwd), block_k=_pow2_tile(s, fwd),
      block_q_dkv=_pow2_tile(t, bwd), block_kv_dkv=_pow2_tile(s, bwd),
      block_q_dq=_pow2_tile(t, bwd), block_kv_dq=_pow2_tile(s, bwd))
  return gpu_attention.mha(q, k, v, segment_ids, sm_scale=dh ** -0.5, causal=causal,
                           block_sizes=sizes, interpret=interpret)


_LANES = 128  # splash attention's tiles are multiples of the TPU lane width


def _splash_kernel(t: int, s: int, group: int, causal: bool, tq: int, tk: int,
                   interpret: bool):
  """A multi-query splash kernel for ``group`` query heads over one K/V head. Built per
  trace (not cached: it holds arrays made inside the trace that builds it)."""
  _, splash, masks = _pallas_modules()
  head = masks.CausalMask((t, s)) if causal else masks.FullMask((t, s))
  sizes = splash.BlockSizes(block_q=tq, block_kv=tk, block_kv_compute=tk, block_q_dkv=tq,
                            block_kv_dkv=tk, block_kv_dkv_compute=tk, block_q_dq=tq,
                            block_kv_dq=tk)
  return splash.make_splash_mqa_single_device(masks.MultiHeadMask([head] * group),
                                              block_sizes=sizes, interpret=interpret)


def pallas_tpu_attention(q, k, v, *, causal: bool, block: int = 0, segment_ids=None,
                         interpret: bool = False) -> jax.Array:
  """TPU splash attention, one multi-query kernel call per K/V head (GQA groups)."""
  _, splash, _ = _pallas_modules()
  _require_backend("pallas_tpu", "tpu", interpret)
  _check_self_attention("pallas_tpu", q, k, segment_ids)
  b, t, h, dh = q.shape
  s, kv = k.shape[1], k.shape[2]
  if t % _LANES or s % _LANES:
    raise ValueError(f"attention_impl='pallas_tpu' (splash attention) needs query and key "
                     f"lengths that are multiples of {_LANES}, got {t} and {s}")
  cap = max(_LANES, min(block or 512, 512)) // _LANES
  tq, tk = _LANES * _pow2_tile(t // _LANES, cap), _LANES * _pow2_tile(s // _LANES, cap)
  kernel = _splash_kernel(t, s, h // kv, causal, tq, tk, bool(interpret))
  qg = (q * jnp.asarray(dh ** -0.5, q.dtype)).reshape(b, t, kv, h // kv, dh)
  qg = qg.transpose(0, 2, 3, 1, 4)                        # [b, kv, g, t, dh]
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, kv, s, dh]

  def one_row(qr, kr, vr, seg):
    ids = None if seg is None else splash.SegmentIds(q=seg, kv=seg)
    return jax.vmap(lambda qh, kh_, vh_: kernel(qh, kh_, vh_, segment_ids=ids))(qr, kr, vr)
  if segment_ids is None:
    out = jax.vmap(lambda qr, kr, vr: one_row(qr, kr, vr, None))(qg, kh, vh)
  else:
    out = jax.vmap(one_row)(qg, kh, vh, segment_ids)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


KERNELS = {"xla": xla_attention, "cudnn": cudnn_attention, "pallas_gpu": pallas_gpu_attention,
           "pallas_tpu": pallas_tpu_attention}


def attend(q, k, v, *, causal: bool, block: int = 0, segment_ids=None) -> jax.Array:
  """Attention by the kernel selected with :func:`use_kernel` (default ``xla``)."""
  choice = _CHOICE.get()
  return KERNELS[choice.impl](q, k, v, causal=causal, block=block, segment_ids=segment_ids,
                              interpret=choice.interpret)

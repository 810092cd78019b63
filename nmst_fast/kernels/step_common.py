"""What the decoding kernels share: the head's float64 math per row, Philox keys and uniforms, the
candidate keys, the inverse-CDF pick, and the host side of their arguments (RNG state, float64
scalars) and outputs.

The head's scalars are those of ``nmst_fast.decoding.distribution``: a = log(1 − α_t),
ζ_eos = L + log(1 − e^a) − a, log_norm = L − a. Float64 math uses only exp and log (``expm1`` and
``log1p`` by Kahan's formulas), which the CPU interpreter runs too.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import host_math

HEAD_CODES = {"va": 0, "nmst": 1, "st": 2}
NO_ROW = tl.constexpr(host_math.NO_ROW)  # a one-call pair starts at B instead


@triton.jit
def column_keys(x, cols):
    """One int64 key per (fp32 value, column): keys sorted descending are (value desc, column asc)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0 as floats: give them one key so they tie
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def decode_column_keys(keys):
    """(x as float64, column) of keys made by ``column_keys``; padding decodes to (-inf, -1)."""
    padding = keys == -9223372036854775808
    ordered = (keys >> 32).to(tl.int32)
    value_bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    values = tl.where(padding, float("-inf"), value_bits.to(tl.float32, bitcast=True).to(tl.float64))
    return values, tl.where(padding, -1, 0x7FFFFFFF - (keys & 0xFFFFFFFF))


@triton.jit
def philox_key(rng_ptr, STREAM: tl.constexpr):
    """The Philox key of this launch's draws on STREAM (the scan's columns 0, the finish 1, the row
    draw's rounds 2) from the step's RNG state at ``rng_ptr`` (int64: seed < 2^31, calls, arrivals):
    the seed in the low word, calls · 4 + STREAM in the high one. The launch's last program advances
    ``calls`` (:func:`advance_calls`), so each call, or replay of a captured one, draws afresh."""
    return tl.load(rng_ptr) | ((tl.load(rng_ptr + 1) * 4 + STREAM) << 32)


@triton.jit
def advance_calls(rng_ptr):
    """The next call's RNG state; only the launch's last program, after every program read its key."""
    tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)


@triton.jit
def uniform_f64(key, offsets):
    """U(0, 1) with 53 random bits per offset, never 0 or 1, from Philox keyed by ``key``
    (:func:`philox_key`)."""
    r0, r1, _, _ = tl.randint4x(key, offsets)
    hi = (r0.to(tl.uint32, bitcast=True) >> 5).to(tl.float64)
    lo = (r1.to(tl.uint32, bitcast=True) >> 6).to(tl.float64)
    return (hi * 67108864.0 + lo + 0.5) / 9007199254740992.0


@triton.jit
def crossing_with(cum, weights, target, index, SIZE, payload, none):
    """Along the last axis, per row: the first index of positive weight whose cumulative weight ``cum``
    exceeds ``target`` (the last positive one when rounding leaves none, -1 when there is none), and
    ``payload`` there (``none`` where there is no positive weight). Only positive weights may be
    picked: a GPU's parallel scan is not monotone to the last ulp, and a zero weight after a block
    boundary can read above its predecessor (an H200 drew outside the nucleus that way)."""
    positive = weights > 0
    crossing = (cum > tl.expand_dims(target, -1)) & positive
    axis: tl.constexpr = len(crossing.shape) - 1
    pick = tl.min(tl.where(crossing, index, SIZE), axis=axis)
    pick = tl.where(pick < SIZE, pick, tl.max(tl.where(positive, index, -1), axis=axis))
    at = (index == tl.expand_dims(pick, -1)) & positive  # the pick's one entry
    value = tl.where(pick >= 0, tl.sum(tl.where(at, payload, 0), axis=axis), none)
    return pick, value


@triton.jit
def head_inputs(
    z_ptr, z_row_stride, rows, row_ok, eos_index, steps_ptr, steps_stride, steps_value, state_ptr, state_stride,
    HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """What the head math reads per row: (eos's raw logit s as fp64, t as int64, ST's previous state as
    fp64; 0 where there is none). No program writes it, so the one-launch step loads it before a row's
    arrival; loads go before any math (the compiler does not move a load across the fp64 log/exp
    branches)."""
    if HEAD == 0:
        s = tl.zeros((BLOCK_B,), tl.float64)
    else:
        s = tl.load(z_ptr + rows.to(tl.int64) * z_row_stride + eos_index, mask=row_ok, other=0.0).to(tl.float64)
    if STEPS_PER_ROW:
        t = tl.load(steps_ptr + rows.to(tl.int64) * steps_stride, mask=row_ok, other=1).to(tl.int64)
    else:
        t = tl.full((BLOCK_B,), steps_value, tl.int64)
    if HAS_STATE:
        prev = tl.load(state_ptr + rows.to(tl.int64) * state_stride, mask=row_ok, other=0.0).to(tl.float64)
    else:
        prev = tl.zeros((BLOCK_B,), tl.float64)
    return s, t, prev


@triton.jit
def survival_terms(s, t, prev, rows, row_ok, log1m_eps_hi, log1m_eps_lo, new_state_ptr, HEAD: tl.constexpr):
    """The NMST/ST terms that need no partial, from the raw eos logit s, t and (ST) the state ``prev``:
    (a = log(1 − α_t) floored at −1e300 as the torch path's LOG_SURVIVAL_FLOOR, log α_t = log(1 − e^a),
    rows whose eos logit or ST state is NaN or the state positive); stores ST's new state. Context rows
    (t <= 0): a = 0, ST's state passes through. Run while the partials' loads are in flight. VA: its
    inputs (:func:`head_inputs`' zeros), unused."""
    if HEAD == 0:
        return s, s, s != s
    # fp64 scalars arrive as fp32 (hi, lo) pairs: Triton passes Python floats as fp32.
    log1m_eps = tl.cast(log1m_eps_hi, tl.float64) + tl.cast(log1m_eps_lo, tl.float64)
    if HEAD == 1:
        a = tl.where(t >= 1, _log_sigmoid(-s) + t.to(tl.float64) * log1m_eps, 0.0)
    else:
        prev = tl.where(prev > 0.0, float("nan"), prev)  # not a log(1 − α): the row is flagged
        running = prev + _log_sigmoid(s) + log1m_eps
        tl.store(new_state_ptr + rows, tl.where(t >= 1, running, prev), mask=row_ok)
        # A NaN state (flagged) stays NaN on a context row too: the row is reported, not decoded.
        a = tl.where(t >= 1, running, tl.where(prev != prev, prev, 0.0))
    return tl.maximum(a, -1e300), _log1mexp(a), (s != s) | (a != a)


@triton.jit
def with_lse(lse, survival, HEAD: tl.constexpr):
    """(log_norm = L − a, ζ_eos = L + log α_t − a (−inf for VA), rows without a distribution: L not
    finite, or a NaN row of :func:`survival_terms`) from L and ``survival``, that function's result."""
    bad = ~(tl.abs(lse) < float("inf"))  # NaN, +inf, or no finite non-eos logit
    if HEAD == 0:
        return lse, tl.full(lse.shape, float("-inf"), tl.float64), bad
    a_floor, log_alpha, eos_nan = survival
    return lse - a_floor, lse + log_alpha - a_floor, bad | eos_nan


@triton.jit
def _expm1(x):
    """exp(x) − 1 in fp64 to a few ulps (Kahan), for x <= 0."""
    u = tl.exp(x)
    um1 = u - 1.0
    plain = (um1 == 0.0) | (um1 == -1.0)  # |x| below 1 ulp of 1, or exp underflowed
    log_u = tl.log(tl.where(plain, 2.0, u))
    return tl.where(um1 == 0.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / log_u))


@triton.jit
def _log1p(x):
    """log(1 + x) in fp64 to a few ulps (Kahan), for x > -1."""
    u = 1.0 + x
    um1 = u - 1.0
    return tl.where(um1 == 0.0, x, tl.log(u) * x / tl.where(um1 == 0.0, 1.0, um1))


@triton.jit
def _log_sigmoid(x):
    return tl.minimum(x, 0.0) - _log1p(tl.exp(-tl.abs(x)))


@triton.jit
def _log1mexp(a):
    """log(1 − e^a) for a <= 0 (−inf at a = 0), switching branches at −ln 2 as the torch path does."""
    near = a > -0.6931471805599453
    at_zero = a == 0.0
    near_arg = -_expm1(tl.where(near & ~at_zero, a, -0.6931471805599453))
    far = _log1p(-tl.exp(tl.where(near, -0.6931471805599453, a)))
    return tl.where(at_zero, float("-inf"), tl.where(near, tl.log(near_arg), far))


def rng_state(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernels' RNG state, (3,) int64 on ``device``: (seed, calls, arrivals). A (3,) int64 tensor
    there is the state itself (a ``DecodingStep``'s: its launches advance ``calls``); an int or a
    one-element integer tensor, a fresh state at call 0."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype == torch.int64 and seed.shape == (3,) and seed.device == device:
            return seed
        if seed.numel() != 1 or seed.dtype.is_floating_point:
            raise ValueError("seed must be a one-element integer tensor or a (3,) int64 RNG state")
        seed = seed.reshape(1).to(device=device, dtype=torch.int64)
        return torch.cat([seed, seed.new_zeros(2)])
    return torch.tensor([seed, 0, 0], dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=256)  # a step's temperature, ε and p recur every call
def split_f64(value: float) -> tuple[float, float]:
    """(hi, lo) fp32-representable parts of a float64 (hi + lo == value to ~1e-16 relative)."""
    try:
        hi = _FP32.unpack(_FP32.pack(value))[0]  # round to fp32 (struct: ~10x faster than a numpy scalar)
    except OverflowError:  # beyond fp32's range, as a numpy fp32 scalar would round it
        hi = math.copysign(math.inf, value)
    return hi, value - hi


_FP32 = struct.Struct("f")


@dataclass
class Selection:
    """One token per row; every tensor is on the logits' device."""

    tokens: torch.Tensor  # (B,) int64
    log_probs: torch.Tensor  # (B,) float64 log p of each chosen token (untruncated distribution)
    state: Optional[torch.Tensor]  # (B,) float64 ST's log(1 − α_t) after this step; None for other heads
    # (2,) int32: [first row without a distribution, first row left without a token (the row draw's
    # rounds ran out): its token is invalid]; B (NO_ROW in a step's deferred pair) means none
    flags: torch.Tensor


class Outputs:
    """Output buffers plus the head arguments every select kernel takes, in kernel order."""

    def __init__(self, z: torch.Tensor, head: str, eps: float, steps: int | torch.Tensor,
                 state: Optional[torch.Tensor], flags: Optional[torch.Tensor] = None):
        B, device = z.shape[0], z.device
        self.tokens = torch.empty(B, dtype=torch.int64, device=device)
        self.log_probs = torch.empty(B, dtype=torch.float64, device=device)
        # Other heads store no state: any fp64 pointer will do.
        self.state = torch.empty(B, dtype=torch.float64, device=device) if head == "st" else self.log_probs
        # The kernels atomic_min bad rows into the flags: a new pair at B (none), or the caller's as it stands.
        self.flags = torch.full((2,), B, dtype=torch.int32, device=device) if flags is None else flags
        self.steps_per_row = isinstance(steps, torch.Tensor)
        self.has_state = head == "st" and state is not None
        steps_tensor = steps if self.steps_per_row else self.tokens  # any pointer when unused
        state_tensor = state if self.has_state else self.log_probs
        self.head_args = (
            *split_f64(math.log1p(-eps)),
            steps_tensor, steps_tensor.stride(0) if self.steps_per_row else 0, 0 if self.steps_per_row else int(steps),
            state_tensor, state_tensor.stride(0) if self.has_state else 0,
        )

    def selection(self, head: str) -> Selection:
        return Selection(self.tokens, self.log_probs, self.state if head == "st" else None, self.flags)

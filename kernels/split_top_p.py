"""Top-p by rejection with every row spread over V-split programs: the row draw's rounds for one row.

``kernels/row_draw.py`` runs top-p's rejection rounds in one program per row. For a single row that
leaves all but one SM idle, and one program streams a row at a few GB/s. Here the same rounds run
on the split-V layout of ``row_scan`` (several programs per row, each one slice of V). Since the
H200 run (RESULTS.md, fourteenth session) only one-row steps take this path
(``nmst_fast.decoding.fused.TOP_P_ROW_DRAW_MIN_ROWS``): at B = 32 its launches took 115-185 µs
where the lane row draw needs at most what 256 rows took, 38-91 µs.

* round 0 is the drawing scan (``row_scan.scan_partials`` with a seed): per split, the online
  (max, Σ e^(x − max)) and one column drawn ∝ e^x;
* each later launch r starts by *deciding* round r − 1 and then runs pass r over its slice.
  Every program of a row makes the same decision from the same partials and uniforms, so no
  separate decide kernel is needed (one program per row stores it):
    - round 0: the head's float64 scalars (``nucleus._row_head``) from the merged partials, and a
      first candidate c₁ drawn from the whole distribution (eos by its mass, else a split by its
      mass, whose drawn column is the token);
    - round k ≥ 1: pass k's sums give the mass ranked before c_k. Below p: c_k is the draw.
      Otherwise the tokens ranked before c_k (and eos if it ranks before c_k) are the new set S,
      and c_{k+1} is drawn from S by the same split/column scheme from pass k's own draws;
  pass r then sums, per split, the mass ranked before c_r (fp32 along each lane, float64 across
  lanes and splits in a fixed order, as the row draw: ``lanes.ranked_lane_mass``) and draws one
  column per split from the tokens ranked before c_r (a lane by its mass, then a column of it);
* a last launch decides the last pass without starting another.

Exactness is the row draw's argument: a draw from S ⊇ nucleus that is accepted iff it lies in the
nucleus is a nucleus draw, whatever happened in earlier rounds; the fixed reduction order keeps
the acceptance monotone along the ranking, so the accepted set is a prefix. Rows still rejected
after the launched rounds are flagged (flags[1]); :meth:`SplitTopP.advance` launches more rounds
on the same chain (launch r re-derives round r − 1's decision, so chaining is seamless).

Buffers alternate between two slots (pass r writes slot r % 2 while launch r reads slot
(r − 1) % 2), so a launch never reads what it writes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, scan_width
from .nucleus import _load_x, _row_head
from .row_draw import _fp32_floor, _ranked_before
from .lanes import LOG2E, lane_pointers, ranked_lane_mass
from .row_scan import first_crossing, interpreter_block_rows, launch_shape, scan_partials, uniform_pair
from .row_select import HEAD_CODES, Selection, _Outputs, _split_f64, _uniform_f64_stream

FIRST_ROUNDS = 3  # rounds the first launch sequence tests (top-p 0.9: ~1% of rows need a second)
MORE_ROUNDS = 3  # rounds per continuation
MAX_ROUNDS = 32  # then the caller takes the nucleus cut
# The rounds' tile width on a GPU (timed at 2048 when their passes still reduced every tile; the
# lane passes are not yet swept).
ROUND_BLOCK_V = 2048
# Philox streams: the scan's draw 0, the cut's draw 1, the row draw 2. The decisions take 3; pass
# r's draw takes PASS_STREAM + r.
DECIDE_STREAM = 3
PASS_STREAM = 4


# round_no is not specialized: Triton would turn a 1 into a constant (no .to()), and one compile
# serves every round of a FIRST/PASS variant.
@triton.jit(do_not_specialize=["round_no"])
def _round_kernel(
    z_ptr, z_row_stride, n_rows, V, split_width, n_splits, eos_index, inv_temp,
    log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride, steps_value, state_ptr, state_stride,
    top_p_hi, top_p_lo, seed_ptr, round_no, max_rounds,
    scan_max_ptr, scan_sum_ptr, scan_draw_ptr,  # (rows, n_splits): round 0's partials
    f64_ws, i32_ws,  # the step's state in one buffer per dtype (layout below)
    token_ptr, log_prob_ptr, new_state_ptr, flags_ptr,
    HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr, HAS_STATE: tl.constexpr,
    FIRST: tl.constexpr,  # round_no == 1: decide round 0 from the scan's partials
    PASS: tl.constexpr,  # run pass round_no after deciding (False: the last launch)
    BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    LANE_TILES: tl.constexpr,  # a lane's columns in one split (tiles per split, padded)
):
    HAS_EOS: tl.constexpr = HEAD != 0
    # The workspaces: per row the head's scalars (round 1 stores them), per row and
    # slot the chain (the candidate under test and the set it was drawn from), per row, slot and
    # split a pass's mass ranked before its candidate and its draw.
    row_max_ptr = f64_ws
    w_ptr = f64_ws + n_rows
    p_eos_ptr = f64_ws + 2 * n_rows
    eos_zeta_ptr = f64_ws + 3 * n_rows
    log_norm_ptr = f64_ws + 4 * n_rows
    pivot_value_ptr = f64_ws + 5 * n_rows
    cand_zeta_ptr = f64_ws + 7 * n_rows
    before_ptr = f64_ws + 9 * n_rows
    rounds_ptr = i32_ws
    pending_ptr = i32_ws + n_rows
    pivot_col_ptr = i32_ws + 3 * n_rows
    cand_token_ptr = i32_ws + 5 * n_rows
    eos_before_ptr = i32_ws + 7 * n_rows
    pick_ptr = i32_ws + 9 * n_rows
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    split = tl.program_id(1)
    row_ok = rows < n_rows
    stores = row_ok & ((rows * 0 + split) == 0)  # one program per row records the (shared) decision
    split_no = tl.arange(0, BLOCK_S)[None, :]
    part = rows.to(tl.int64)[:, None] * n_splits + split_no
    part_ok = row_ok[:, None] & (split_no < n_splits)
    slot_in = ((round_no - 1) % 2) * n_rows  # what launch round_no reads ...
    slot_out = (round_no % 2) * n_rows  # ... and writes
    threshold = tl.cast(top_p_hi, tl.float64) + tl.cast(top_p_lo, tl.float64)
    seed = tl.load(seed_ptr)

    # 1. Decide round round_no − 1: the set S to draw from (per-split weights in units of e^(x − M),
    # their draws, eos's membership) and the pivot S stays below if no candidate can be drawn.
    if FIRST:
        split_max = tl.load(scan_max_ptr + part, mask=part_ok, other=float("-inf"))
        split_sum = tl.load(scan_sum_ptr + part, mask=part_ok, other=0.0).to(tl.float64)
        m = tl.where(row_ok, tl.max(split_max, axis=1), 0.0)
        m_shift = tl.where(m == float("-inf"), 0.0, m)
        scaled = split_sum * tl.exp((split_max - m_shift[:, None]).to(tl.float64))  # a NaN stays: flagged
        weights = tl.where(split_sum > 0.0, scaled, 0.0)
        log_norm, eos_zeta, p_eos, w, bad = _row_head(
            m, tl.sum(scaled, axis=1), z_ptr, z_row_stride, rows, row_ok, eos_index, log1m_eps_hi, log1m_eps_lo,
            steps_ptr, steps_stride, steps_value, state_ptr, state_stride, new_state_ptr, HEAD, STEPS_PER_ROW,
            HAS_STATE, BLOCK_B)
        pending = row_ok & ~bad
        eos_in = pending & (p_eos > 0.0)
        weights = tl.where(pending[:, None], weights, 0.0)
        total = tl.where(eos_in, p_eos, 0.0) + w * tl.sum(weights, axis=1)
        picks = tl.load(scan_draw_ptr + part, mask=part_ok, other=0)
        pivot_value = tl.full((BLOCK_B,), float("-inf"), tl.float32)  # S = every token
        pivot_col = tl.full((BLOCK_B,), 0, tl.int32) + V
        tl.store(row_max_ptr + rows, m.to(tl.float64), mask=stores)
        tl.store(w_ptr + rows, w, mask=stores)
        tl.store(p_eos_ptr + rows, p_eos, mask=stores)
        tl.store(eos_zeta_ptr + rows, eos_zeta, mask=stores)
        tl.store(log_norm_ptr + rows, log_norm, mask=stores)
        tl.atomic_min(flags_ptr, tl.min(tl.where(bad & stores, rows, n_rows), axis=0))
        tl.store(rounds_ptr + rows, tl.zeros((BLOCK_B,), tl.int32), mask=stores)  # rows never drawn: 0
    else:
        m = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # stored exactly
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        p_eos = tl.load(p_eos_ptr + rows, mask=row_ok, other=0.0)
        eos_zeta = tl.load(eos_zeta_ptr + rows, mask=row_ok, other=0.0)
        log_norm = tl.load(log_norm_ptr + rows, mask=row_ok, other=0.0)
        chain = slot_in + rows
        pending = tl.load(pending_ptr + chain, mask=row_ok, other=0) != 0
        pivot_value = tl.load(pivot_value_ptr + chain, mask=row_ok, other=0.0).to(tl.float32)
        pivot_col = tl.load(pivot_col_ptr + chain, mask=row_ok, other=0)
        eos_in = pending & (tl.load(eos_before_ptr + chain, mask=row_ok, other=0) != 0)
        slot_part = slot_in.to(tl.int64) * n_splits + part
        weights = tl.load(before_ptr + slot_part, mask=part_ok & pending[:, None], other=0.0)
        mass_before = w * tl.sum(weights, axis=1) + tl.where(eos_in, p_eos, 0.0)
        accept = pending & ((mass_before < threshold) | (mass_before == 0.0))  # the first token is always kept
        cand_token = tl.load(cand_token_ptr + chain, mask=row_ok, other=0).to(tl.int64)
        cand_zeta = tl.load(cand_zeta_ptr + chain, mask=row_ok, other=0.0)
        tl.store(token_ptr + rows, cand_token, mask=stores & accept)
        tl.store(log_prob_ptr + rows, cand_zeta - log_norm, mask=stores & accept)
        tl.store(rounds_ptr + rows, tl.zeros((BLOCK_B,), tl.int32) + (round_no - 1), mask=stores & accept)
        pending = pending & ~accept
        total = mass_before  # S: the tokens ranked before the rejected candidate (its pivot)
        picks = tl.load(pick_ptr + slot_part, mask=part_ok, other=0)

    # 2. Draw the next candidate from S: eos by its mass, else a split by its mass, whose draw is it.
    goal = _uniform_f64_stream(seed, rows * (max_rounds + 1) + (round_no - 1), 3) * total
    eos_part = tl.where(eos_in, p_eos, 0.0)
    is_eos = eos_in & ((goal < eos_part) | (tl.sum(weights, axis=1) <= 0.0))
    goal_e = (goal - eos_part) / tl.where(w > 0.0, w, 1.0)
    chosen, _weight_before = first_crossing(weights, goal_e, split_no, BLOCK_S)
    col = tl.sum(tl.where(split_no == chosen[:, None], picks, 0), axis=1)
    drawn = pending & (is_eos | (chosen >= 0))  # else S keeps its pivot and the next round redraws
    x = tl.load(z_ptr + rows.to(tl.int64) * z_row_stride + col, mask=drawn & ~is_eos, other=0.0).to(tl.float32)
    x = x * inv_temp  # as _load_x rounds it, so the pivot compares equal to its own column
    x64 = x.to(tl.float64)
    eos_floor, eos_exact = _fp32_floor(eos_zeta)  # eos as a pivot (fp32 compares along the row)
    pivot_value = tl.where(drawn, tl.where(is_eos, eos_floor, x), pivot_value)
    pivot_col = tl.where(drawn, tl.where(is_eos, tl.where(eos_exact, eos_index, 0), col), pivot_col)
    eos_before = eos_in & ~is_eos & ((eos_zeta > x64) | ((eos_zeta == x64) & (eos_index < col)))
    eos_before = tl.where(drawn, eos_before, eos_in)
    chain_out = slot_out + rows
    tl.store(pending_ptr + chain_out, pending.to(tl.int32), mask=stores)
    tl.store(pivot_value_ptr + chain_out, pivot_value.to(tl.float64), mask=stores)
    tl.store(pivot_col_ptr + chain_out, pivot_col, mask=stores)
    tl.store(cand_token_ptr + chain_out, tl.where(is_eos, eos_index, col), mask=stores)
    tl.store(cand_zeta_ptr + chain_out, tl.where(is_eos, eos_zeta, x64), mask=stores)
    tl.store(eos_before_ptr + chain_out, eos_before.to(tl.int32), mask=stores)

    if PASS:
        # 3. Pass round_no over this split: per lane, the mass ranked before the candidate (fp32 along
        # the lane, float64 across lanes; no reduction per tile), and one column drawn from those
        # tokens — a lane by its mass, then a column of the lane (its LANE_TILES strided columns).
        lo = split * split_width
        hi = tl.minimum(lo + split_width, V)
        before = tl.zeros((BLOCK_B,), tl.float64)
        pick = tl.zeros((BLOCK_B,), tl.int32)
        if tl.max(pending.to(tl.int32), axis=0) > 0:  # rows already drawn read nothing
            lanes = tl.arange(0, BLOCK_V)[None, :]
            lane_e = ranked_lane_mass(lane_pointers(z_ptr, z_row_stride, rows, n_rows, BLOCK_B, BLOCK_V), lo, hi,
                                      eos_index, inv_temp, m, pivot_value, pivot_col, False, HAS_EOS, BLOCK_B, BLOCK_V)
            lane_e = tl.where(pending[:, None], lane_e, 0.0)
            before = tl.sum(lane_e.to(tl.float64), axis=1)
            key = seed.to(tl.int64) | ((round_no + 4).to(tl.int64) * 4294967296)  # stream PASS_STREAM + round
            u_lane, u_col = uniform_pair(key, rows, split, n_splits)
            lane, _ = first_crossing(lane_e, u_lane * tl.sum(lane_e, axis=1), lanes, BLOCK_V)
            lane_cols = lo + lane[:, None] + tl.arange(0, LANE_TILES)[None, :] * BLOCK_V
            base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride
            lane_x = _load_x(base, lane_cols, pending & (lane >= 0), V, eos_index, inv_temp, HAS_EOS)
            lane_x = tl.where(lane_cols < hi, lane_x, float("-inf"))
            ranked = _ranked_before(lane_x, lane_cols, pivot_value, pivot_col)
            col_e = tl.where(ranked, tl.exp2((lane_x - m[:, None]) * LOG2E), 0.0)
            drawn_col, _ = first_crossing(col_e, u_col * tl.sum(col_e, axis=1), lane_cols, V)
            pick = tl.where(drawn_col >= 0, drawn_col, 0)
        out = (slot_out.to(tl.int64) * n_splits + rows.to(tl.int64) * n_splits) + split
        tl.store(before_ptr + out, before, mask=row_ok)
        tl.store(pick_ptr + out, pick, mask=row_ok)
    else:
        tl.atomic_min(flags_ptr + 1, tl.min(tl.where(pending & stores, rows, n_rows), axis=0))


class SplitTopP:
    """One step of top-p by split-V rejection rounds; :meth:`advance` launches more rounds.

    Construct it to launch the drawing scan and the first ``rounds`` rounds; ``selection`` then
    holds the draws (flags[1] < B: some row is still rejected, its token invalid) and ``rounds``
    the rounds each accepted row took. Nothing here syncs with the host.
    """

    def __init__(
        self,
        z: torch.Tensor,
        *,
        head: str,
        eos_index: int,
        eps: float,
        temperature: float,
        steps: int | torch.Tensor,
        state: Optional[torch.Tensor],
        seed: torch.Tensor,
        top_p_threshold: float,
        rounds: Optional[int] = None,
        launch: Optional[tuple[int, int]] = None,
    ):
        B, V = z.shape
        if z.stride(1) != 1:
            raise ValueError("z must have unit stride along V")
        rounds = FIRST_ROUNDS if rounds is None else rounds
        if not 1 <= rounds <= MAX_ROUNDS:  # before the scan launches
            raise ValueError(f"rounds must lie in [1, {MAX_ROUNDS}], got {rounds}")
        self.z, self.head = z, head
        self.out = _Outputs(z, head, eps, steps, state)
        self.launched = 0
        block_b, block_v, splits = launch_shape(z, 0, ROUND_BLOCK_V)
        if launch is not None:
            block_v, splits = launch
            if not z.is_cuda:
                block_b = interpreter_block_rows(B, block_v)
        self.scan = scan_partials(z, eos_index=None if head == "va" else eos_index, temperature=temperature,
                                  seed=seed, launch=(block_v, splits))
        self.split_width = cdiv(cdiv(V, splits), block_v) * block_v
        self.splits = self.scan.parts["max"].shape[1]
        # One allocation per dtype (an allocation costs a decoding step's host a few µs): fp64 —
        # 5 head scalars, 2 chain fields × 2 slots per row, then the passes' sums (2, rows, splits);
        # int32 — the rounds, 4 chain fields × 2 slots per row, then the passes' draws.
        self.f64_ws = torch.empty(B * (9 + 2 * self.splits), dtype=torch.float64, device=z.device)
        self.i32_ws = torch.empty(B * (9 + 2 * self.splits), dtype=torch.int32, device=z.device)
        self.rounds = self.i32_ws[:B]
        # The arguments every round launch shares, packed once (a decoding step launches 3-4 rounds;
        # Python work per launch is host time small batches pay).
        self._before_round = (z, z.stride(0), B, V, self.split_width, self.splits, eos_index, 1.0 / temperature,
                              *self.out.head_args, *_split_f64(top_p_threshold), seed)
        self._after_round = (MAX_ROUNDS, self.scan.parts["max"], self.scan.parts["sum"], self.scan.parts["draw_idx"],
                             self.f64_ws, self.i32_ws, self.out.tokens, self.out.log_probs, self.out.state,
                             self.out.flags)
        self._constexprs = dict(HEAD=HEAD_CODES[head], STEPS_PER_ROW=self.out.steps_per_row,
                                HAS_STATE=self.out.has_state, BLOCK_S=scan_width(self.splits), BLOCK_B=block_b,
                                BLOCK_V=block_v, LANE_TILES=scan_width(self.split_width // block_v), num_warps=4)
        self._row_blocks = cdiv(B, block_b)
        self.advance(rounds)

    @property
    def selection(self) -> Selection:
        return self.out.selection(self.head)

    def advance(self, rounds: int) -> None:
        """Test ``rounds`` more candidates per still-rejected row (after resetting flags[1]); at most
        MAX_ROUNDS in all (the decisions' uniforms are numbered per row up to it)."""
        if not 1 <= rounds <= MAX_ROUNDS - self.launched:
            raise ValueError(f"rounds must lie in [1, {MAX_ROUNDS - self.launched}], got {rounds}")
        B = self.z.shape[0]
        if not B:
            return
        if self.launched:
            self.out.flags[1:].fill_(B)
        first, last = self.launched + 1, self.launched + rounds
        for round_no in range(first, last + 2):
            passes = round_no <= last
            _round_kernel[(self._row_blocks, self.splits if passes else 1)](
                *self._before_round, round_no, *self._after_round, FIRST=round_no == 1, PASS=passes,
                **self._constexprs)
        self.launched = last

    def finish(self) -> tuple[int, int]:
        """Launch MORE_ROUNDS at a time while some row is still rejected, up to MAX_ROUNDS in all;
        one host read of the flags per batch of rounds, stopping at an undefined row. Returns the
        flags last read: (first row without a distribution, first row still rejected), B for none."""
        B = self.z.shape[0]
        while True:
            first_bad, first_rejected = self.out.flags.tolist()
            if first_bad < B or first_rejected >= B or self.launched >= MAX_ROUNDS:
                return first_bad, first_rejected
            self.advance(min(MORE_ROUNDS, MAX_ROUNDS - self.launched))

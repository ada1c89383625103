"""Triton kernels for the GPU forward (models/fused.py).

Decode and verify at small batch read every weight once per step and do almost no
arithmetic, so the forward is a stream of weight reads. What stands between that and
the HBM roofline is (a) cuBLAS's small-M GEMMs, which stream a 4096×4096 bf16 weight at
only ~0.6 TB/s on an H200 (FACTS.md), and (b) the ~25 small kernels per layer of the
eager model. These kernels attack both: a skinny GEMM that keeps every SM streaming,
with the neighbouring element-wise work fused into its prologue (RMSNorm) and epilogue
(bias, SiLU·up, residual add), RoPE fused with the KV-cache store, a split-KV attention
that reads only the live part of the cache, and sort-by-expert MoE kernels whose cost
follows the number of distinct experts the tokens touch. Nothing here reads a value back
to the host, so a whole forward can be captured as one CUDA graph.

Numerics: accumulation is fp32; each output element's sum over K runs in the same order
for any number of rows M ≤ 16 (the same tile height), so a token gets bitwise the same
logits in a decode step (T = 1) and inside a verify step (T ≤ 16). That keeps greedy
speculative decoding exactly lossless on the GPU, not only up to bf16 near-ties.

On a machine without a GPU these run under Triton's interpreter (TRITON_INTERPRET=1),
which is how the CPU tests check them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # No GPU: run the kernels in Triton's interpreter (must be chosen before @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _interpreter_numpy2_fix() -> None:
    # The interpreter keeps scalars as 1-element arrays and converts them with int(),
    # which NumPy >= 2.4 refuses for arrays of ndim > 0.
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    original = interp._patch_lang_tensor
    if getattr(original, "_specscope_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._specscope_fixed = True
    interp._patch_lang_tensor = patched


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    _interpreter_numpy2_fix()

# ---------------------------------------------------------------------------------------
# Skinny GEMM: y[M, N] = epilogue(prologue(x)[M, K] @ w[N, K]^T)
# ---------------------------------------------------------------------------------------


@triton.jit
def _linear_epilogue(acc, acc_up, rm, rn, m_ok, n_ok, y_ptr, b_ptr, r_ptr, stride_ym, stride_rm,
                     BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr):
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, r_ptr, g_ptr, xn_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_ym, stride_rm, eps,
    NORM: tl.constexpr, WRITE_XN: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)  # split-K part
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    if NORM:
        # RMSNorm of the input rows, fused: every program recomputes the row scale from
        # x (a few KB, served by L2) instead of paying a separate launch and round trip.
        sq = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            xs = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    k_len = K // SPLIT
    for k0 in range(pid_s * k_len, (pid_s + 1) * k_len, BK):
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        if NORM:
            g = tl.load(g_ptr + k0 + rk).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * g[None, :]).to(w_ptr.dtype.element_ty)
            if WRITE_XN:
                if pid_n == 0:
                    tl.store(xn_ptr + rm[:, None] * K + (k0 + rk)[None, :], x, mask=m_ok[:, None])
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        if SILU_MUL:
            # w holds [gate; up] stacked on N: the up rows are N rows further down.
            wu = tl.load(w_rows + N * K + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PREC)
    if SPLIT == 1:
        _linear_epilogue(acc, acc_up, rm, rn, m_ok, n_ok, y_ptr, b_ptr, r_ptr, stride_ym, stride_rm,
                         BIAS, RESIDUAL, SILU_MUL)
    else:
        # Split-K without atomics on the data: each part writes its fp32 partial, and the
        # last part to arrive (a counter per output tile) sums all parts in a fixed order
        # and runs the epilogue — one launch, and a deterministic result.
        m_pad = tl.num_programs(2) * BM
        part = (pid_s * m_pad + rm)[:, None].to(tl.int64) * N + rn[None, :]
        up_off = SPLIT * m_pad * N
        tl.store(ws_ptr + part, acc, mask=n_ok[None, :])
        if SILU_MUL:
            tl.store(ws_ptr + up_off + part, acc_up, mask=n_ok[None, :])
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(cnt_ptr + tile, 1) == SPLIT - 1:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for sp in tl.static_range(SPLIT):
                off = (sp * m_pad + rm)[:, None].to(tl.int64) * N + rn[None, :]
                acc += tl.load(ws_ptr + off, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(ws_ptr + up_off + off, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (and graph replay)
            _linear_epilogue(acc, acc_up, rm, rn, m_ok, n_ok, y_ptr, b_ptr, r_ptr, stride_ym, stride_rm,
                             BIAS, RESIDUAL, SILU_MUL)


# Split-K scratch, shared by every launch on a device: kernels on one stream never overlap,
# and each launch leaves its counters at zero. Allocated up front (never inside a graph
# capture) by `ensure_scratch`.
SCRATCH_FLOATS = 16 << 20
SCRATCH_COUNTERS = 1 << 16
_scratch: dict = {}


def ensure_scratch(device) -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.device(device)
    if device not in _scratch:
        _scratch[device] = (torch.empty(SCRATCH_FLOATS, dtype=torch.float32, device=device),
                            torch.zeros(SCRATCH_COUNTERS, dtype=torch.int32, device=device))
    return _scratch[device]


def m_tile(m: int) -> int:
    """Tile height for M rows. Every M ≤ 16 shares one tile (and so one summation order)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


# (N, K, BM) → (BN, BK, num_warps, num_stages): the fastest tile of bench/gemv_sweep.py on
# an H200 (weights rotated so L2 does not help; bench/results/h200-2026-11-29-gemv-sweep.json).
# Shapes not listed use the heuristic below.
TUNED: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    # llama3-8b: gate_up (SiLU·up, N = intermediate), down, qkv, wo, lm_head
    (14336, 4096, 16): (32, 256, 4, 3), (14336, 4096, 32): (64, 128, 4, 3), (14336, 4096, 64): (64, 128, 4, 3),
    (4096, 14336, 16): (32, 256, 4, 5), (4096, 14336, 32): (32, 128, 4, 5), (4096, 14336, 64): (32, 128, 4, 5),
    (6144, 4096, 16): (64, 256, 4, 5), (6144, 4096, 32): (64, 256, 4, 3), (6144, 4096, 64): (64, 256, 4, 3),
    (4096, 4096, 16): (32, 256, 4, 5), (4096, 4096, 32): (32, 128, 4, 5), (4096, 4096, 64): (32, 128, 4, 5),
    (128256, 4096, 16): (128, 128, 8, 4), (128256, 4096, 32): (128, 128, 4, 3), (128256, 4096, 64): (128, 128, 4, 3),
    # qwen3-30b-a3b: qkv, wo, lm_head
    (5120, 2048, 16): (64, 256, 4, 5), (5120, 2048, 32): (64, 256, 4, 3), (5120, 2048, 64): (64, 256, 4, 3),
    (2048, 4096, 16): (32, 256, 4, 5, 2),  # split-K: 64 column tiles alone leave SMs idle (2048, 4096, 32): (32, 256, 4, 3), (2048, 4096, 64): (32, 128, 4, 5),
    (151936, 2048, 16): (128, 128, 8, 4), (151936, 2048, 32): (128, 128, 4, 3), (151936, 2048, 64): (128, 128, 4, 3),
}


def _largest_divisor(k: int, options=(256, 128, 64, 32, 16)) -> int:
    for bk in options:
        if k % bk == 0:
            return bk
    return 0


def load_tuned(path: str) -> None:
    """Merge a tile table written by bench/gemv_sweep.py ({"N,K,BM": [BN, BK, warps, stages, split]})."""
    import json

    with open(path) as f:
        for key, cfg in json.load(f)["best"].items():
            TUNED[tuple(int(v) for v in key.split(","))] = tuple(cfg)


if os.environ.get("SPECSCOPE_GEMV_TUNED"):
    load_tuned(os.environ["SPECSCOPE_GEMV_TUNED"])

SMEM_BUDGET = 200 * 1024  # bytes of shared memory a pipelined tile may use (H100/H200: 227 KB)


def smem_bytes(bm: int, bn: int, bk: int, stages: int, weight_tiles: int = 1, elt: int = 2) -> int:
    return stages * (bm + weight_tiles * bn) * bk * elt


def fit_smem(bm, bn, bk, warps, stages, weight_tiles=1, elt=2):
    """Shrink pipelining depth, then BK, until the stages fit in shared memory."""
    while smem_bytes(bm, bn, bk, stages, weight_tiles, elt) > SMEM_BUDGET:
        if stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        else:
            break
    return bn, bk, warps, stages


def linear_config(n: int, k: int, bm: int, sms: int = 132) -> tuple:
    """(BN, BK, num_warps, num_stages[, split-K parts])."""
    if (n, k, bm) in TUNED:
        return TUNED[(n, k, bm)]
    bk = _largest_divisor(k)
    if INTERPRET:  # the interpreter pays per program: few, wide tiles
        return min(128, max(16, triton.next_power_of_2(n))), bk, 4, 1
    # Enough programs to keep every SM streaming (two waves), wide enough tiles that the
    # activation rows are not re-read from L2 more often than the weight is read.
    bn = 16
    for cand in (128, 64, 32):
        if n // cand >= 2 * sms and cand >= bm:
            bn = cand
            break
    return bn, bk, 4, 4


def linear(
    x: torch.Tensor, w: torch.Tensor, *, bias=None, norm=None, eps: float = 1e-6, residual=None,
    silu_mul: bool = False, out=None, out_dtype=None, xn_out=None, config=None,
) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ w[N', K]^T with optional fused RMSNorm of x (weight
    `norm`), bias, SiLU(gate)·up (w = [gate; up], output N = N'/2) and residual add.
    `xn_out` [M, K] receives the normalized input (written by the first column tile)."""
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1 and w.is_contiguous()
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    bm = m_tile(M)
    cfg = tuple(config or linear_config(N, K, bm))
    split = cfg[4] if len(cfg) > 4 else 1
    bn, bk, warps, stages = fit_smem(bm, *cfg[:4], weight_tiles=2 if silu_mul else 1, elt=x.element_size())
    if bk == 0:
        raise ValueError(f"K={K} has no power-of-two factor >= 16; use the eager path")
    n_tiles, m_tiles = triton.cdiv(N, bn), triton.cdiv(M, bm)
    ws = cnt = w
    if split > 1:
        ws, cnt = ensure_scratch(x.device)
        fits = split * m_tiles * bm * N * (2 if silu_mul else 1) <= ws.numel() and n_tiles * m_tiles <= cnt.numel()
        if K % (split * bk) or not fits:
            split, ws, cnt = 1, w, w
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    _linear_kernel[(n_tiles, split, m_tiles)](
        x, w, out, bias if bias is not None else w, residual if residual is not None else out,
        norm if norm is not None else w, xn_out if xn_out is not None else out, ws, cnt,
        M, N, K, x.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0, eps,
        NORM=norm is not None, WRITE_XN=xn_out is not None, BIAS=bias is not None,
        RESIDUAL=residual is not None, SILU_MUL=silu_mul, BM=bm, BN=bn, BK=bk, SPLIT=split, PREC=prec,
        num_warps=warps, num_stages=stages,
    )
    return out


# ---------------------------------------------------------------------------------------
# RoPE (+ Qwen3's q/k RMSNorm) fused with the KV-cache store
# ---------------------------------------------------------------------------------------


@triton.jit
def _rope_store_kernel(
    qkv_ptr, q_ptr, k_cache, v_cache, cos_ptr, sin_ptr, pos_ptr, slot_ptr, nvalid_ptr, qn_ptr, kn_ptr,
    T, L, stride_qkv, stride_pb, stride_cs, stride_ch, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr, TREE: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    hh = tl.program_id(1)  # q heads, then k heads, then v heads
    b = row // T
    t = row % T
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    src = qkv_ptr + row.to(tl.int64) * stride_qkv + hh * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    pos = tl.minimum(tl.load(pos_ptr + b * stride_pb + t), L - 1)
    if hh < H + HKV:
        if QK_NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
            if hh < H:
                w1 = tl.load(qn_ptr + i).to(tl.float32)
                w2 = tl.load(qn_ptr + HALF + i).to(tl.float32)
            else:
                w1 = tl.load(kn_ptr + i).to(tl.float32)
                w2 = tl.load(kn_ptr + HALF + i).to(tl.float32)
            x1 = x1 * rstd * w1
            x2 = x2 * rstd * w2
        # Tables are laid out for rotate-half: both halves of a row are equal.
        c = tl.load(cos_ptr + pos * D + i).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + i).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    if hh < H:
        dst = q_ptr + row.to(tl.int64) * (H * D) + hh * D
        tl.store(dst + i, y1.to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF + i, y2.to(q_ptr.dtype.element_ty))
    else:
        # Rows past nvalid are padding of a CUDA-graph bucket: they must not touch the cache.
        if t < tl.load(nvalid_ptr):
            if TREE:
                # Tree nodes share positions (depth); they are stored side by side after
                # the root instead.
                idx = tl.minimum(tl.load(pos_ptr + b * stride_pb) + t, L - 1)
            else:
                idx = pos
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if hh < H + HKV:
                dst = k_cache + slot * stride_cs + (hh - H) * stride_ch + idx * D
            else:
                dst = v_cache + slot * stride_cs + (hh - H - HKV) * stride_ch + idx * D
            tl.store(dst + i, y1.to(k_cache.dtype.element_ty))
            tl.store(dst + HALF + i, y2.to(k_cache.dtype.element_ty))


def rope_store(qkv, cos, sin, positions, slots, nvalid, k_cache, v_cache, *, n_heads, n_kv, head_dim,
               q_norm=None, k_norm=None, eps=1e-6, tree=False, q_out=None) -> torch.Tensor:
    """qkv [B*T, (H + 2Hkv)·D] → q [B*T, H·D] rotated; k (rotated) and v stored in the cache
    of each row's slot at its position (tree: at positions[b, 0] + t)."""
    B, T = positions.shape
    L = k_cache.shape[2]
    if q_out is None:
        q_out = torch.empty((B * T, n_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    grid = (B * T, n_heads + 2 * n_kv)
    _rope_store_kernel[grid](
        qkv, q_out, k_cache, v_cache, cos, sin, positions, slots, nvalid,
        q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
        T, L, qkv.stride(0), positions.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
        H=n_heads, HKV=n_kv, D=head_dim, QK_NORM=q_norm is not None, TREE=tree, num_warps=1,
    )
    return q_out


# ---------------------------------------------------------------------------------------
# Split-KV attention over the slot cache (flash-decoding), reading only live entries
# ---------------------------------------------------------------------------------------

CHUNK = 64  # keys per split; fixed so a row's result does not depend on T


@triton.jit
def _attn_partial_kernel(
    q_ptr, k_cache, v_cache, slot_ptr, pos_ptr, nvalid_ptr, tree_ptr, o_ptr, m_ptr, l_ptr,
    T, L, R, NCH, HKV, stride_pb, stride_cs, stride_ch, sm_scale,
    G: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr, TREE: tl.constexpr,
    PREC: tl.constexpr,
):
    c = tl.program_id(0)
    hr = tl.program_id(1)
    b = tl.program_id(2)
    n_rb = tl.cdiv(R, BR)
    kvh = hr // n_rb
    rb = hr % n_rb
    start = tl.load(pos_ptr + b * stride_pb)
    kv_len = tl.minimum(start + T, L)
    lo = c * CH
    if lo < kv_len:  # splits past the live length do nothing (the grid covers the whole cache)
        r = rb * BR + tl.arange(0, BR)  # row r = t * G + g: query token t, head kvh * G + g
        r_ok = r < R
        t = r // G
        g = r % G
        d = tl.arange(0, D)
        q = tl.load(q_ptr + ((b * T + t) * (HKV * G) + kvh * G + g)[:, None].to(tl.int64) * D + d[None, :],
                    mask=r_ok[:, None], other=0.0)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        kbase = k_cache + slot * stride_cs + kvh * stride_ch
        vbase = v_cache + slot * stride_cs + kvh * stride_ch
        j = lo + tl.arange(0, CH)
        j_ok = j < kv_len
        k = tl.load(kbase + j[:, None] * D + d[None, :], mask=j_ok[:, None], other=0.0)
        v = tl.load(vbase + j[:, None] * D + d[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        rel = j - start  # key index relative to the first new token
        nvalid = tl.load(nvalid_ptr)
        if TREE:
            in_new = (rel >= 0) & (rel < nvalid)
            anc = tl.load(tree_ptr + b * T * T + t[:, None] * T + rel[None, :],
                          mask=r_ok[:, None] & in_new[None, :], other=0)
            vis = (rel[None, :] < 0) | (in_new[None, :] & (anc != 0))
        else:
            vis = rel[None, :] <= t[:, None]
        vis = vis & j_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        # A finite floor keeps rows that see nothing in this split NaN-free (p = 0, l = 0).
        m = tl.maximum(tl.max(s, axis=1), -1e30)
        p = tl.exp(s - m[:, None])
        l = tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)
        base = (b * HKV + kvh) * NCH + c
        tl.store(o_ptr + (base * R + r)[:, None].to(tl.int64) * D + d[None, :], acc, mask=r_ok[:, None])
        tl.store(m_ptr + base * R + r, m, mask=r_ok)
        tl.store(l_ptr + base * R + r, l, mask=r_ok)


@triton.jit
def _attn_combine_kernel(
    o_ptr, m_ptr, l_ptr, pos_ptr, out_ptr, T, L, R, NCH, HKV, stride_pb,
    G: tl.constexpr, D: tl.constexpr, CH: tl.constexpr, BC: tl.constexpr,
):
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // T
    t = bt % T
    kvh = h // G
    r = t * G + h % G
    start = tl.load(pos_ptr + b * stride_pb)
    n = tl.cdiv(tl.minimum(start + T, L), CH)
    d = tl.arange(0, D)
    base = (b * HKV + kvh) * NCH
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for c0 in range(0, n, BC):
        c = c0 + tl.arange(0, BC)
        ok = c < n
        m_c = tl.load(m_ptr + (base + c) * R + r, mask=ok, other=float("-inf"))
        l_c = tl.load(l_ptr + (base + c) * R + r, mask=ok, other=0.0)
        o_c = tl.load(o_ptr + ((base + c) * R + r)[:, None].to(tl.int64) * D + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_c, 0))
        scale = tl.exp(m_run - m_new)
        w = tl.exp(m_c - m_new)
        acc = acc * scale + tl.sum(w[:, None] * o_c, 0)
        l_run = l_run * scale + tl.sum(w * l_c, 0)
        m_run = m_new
    tl.store(out_ptr + (bt * (HKV * G) + h).to(tl.int64) * D + d, (acc / l_run).to(out_ptr.dtype.element_ty))


def attention(q, k_cache, v_cache, slots, positions, nvalid, *, n_heads, n_kv, head_dim, tree_mask=None,
              out=None) -> torch.Tensor:
    """q [B*T, H·D] (rotated) against the cache of each row's slot: keys before
    positions[b, 0] plus, among the T new ones, the causal prefix or the tree ancestors
    (tree_mask [B, T, T], nonzero = visible). Reads only min(positions[b,0] + T, L) keys.
    Returns [B*T, H·D]."""
    B, T = positions.shape
    L = k_cache.shape[2]
    G = n_heads // n_kv
    R = G * T
    # One row-tile height for every T, so each row's reductions (and so its result) are
    # the same in a decode step and in a verify step. (Smaller in the CPU interpreter.)
    BR = 16 if INTERPRET else 64
    nch = triton.cdiv(L, CHUNK)
    o_part = torch.empty((B, n_kv, nch, R, head_dim), dtype=torch.float32, device=q.device)
    m_part = torch.empty((B, n_kv, nch, R), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (nch, n_kv * triton.cdiv(R, BR), B)
    _attn_partial_kernel[grid](
        q, k_cache, v_cache, slots, positions, nvalid, tree_mask if tree_mask is not None else nvalid,
        o_part, m_part, l_part, T, L, R, nch, n_kv, positions.stride(0), k_cache.stride(0), k_cache.stride(1),
        head_dim ** -0.5, G=G, D=head_dim, BR=BR, CH=CHUNK, TREE=tree_mask is not None, PREC=prec, num_warps=4,
    )
    if out is None:
        out = torch.empty((B * T, n_heads * head_dim), dtype=q.dtype, device=q.device)
    _attn_combine_kernel[(B * T, n_heads)](
        o_part, m_part, l_part, positions, out, T, L, R, nch, n_kv, positions.stride(0),
        G=G, D=head_dim, CH=CHUNK, BC=16, num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------
# Mixture of experts: route (softmax top-k, sort by expert), grouped GEMMs, combine
# ---------------------------------------------------------------------------------------


@triton.jit
def _moe_route_kernel(
    logits_ptr, key_ptr, e_ptr, wflat_ptr, w_ptr, perm_ptr, inv_ptr, gexp_ptr, gstart_ptr, gend_ptr, ng_ptr,
    M, E,
    TOPK: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, NORM_TOPK: tl.constexpr,
):
    # One program: M ≤ 64 tokens × E ≤ a few hundred experts fit in registers.
    rm = tl.arange(0, BM)
    re = tl.arange(0, BE)
    kk = tl.arange(0, KP)
    lg = tl.load(logits_ptr + rm[:, None] * E + re[None, :], mask=(rm[:, None] < M) & (re[None, :] < E), other=0.0)
    lg = tl.where(re[None, :] < E, lg.to(tl.float32), float("-inf"))
    ex = tl.exp(lg - tl.max(lg, axis=1)[:, None])
    p = ex / tl.sum(ex, axis=1)[:, None]
    top_w = tl.zeros((BM, KP), tl.float32)
    top_e = tl.zeros((BM, KP), tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=1)
        arg = tl.argmax(p, axis=1).to(tl.int32)
        top_w = tl.where(kk[None, :] == j, best[:, None], top_w)
        top_e = tl.where(kk[None, :] == j, arg[:, None], top_e)
        p = tl.where(re[None, :] == arg[:, None], -1.0, p)
    if NORM_TOPK:
        top_w = top_w / tl.sum(tl.where(kk[None, :] < TOPK, top_w, 0.0), axis=1)[:, None]
    # Pair i = m * TOPK + j. Sort pairs by (expert, i) so each expert's tokens are
    # contiguous; padding pairs get keys past every real expert.
    NP: tl.constexpr = BM * KP
    pair = rm[:, None] * TOPK + kk[None, :]
    valid = (rm[:, None] < M) & (kk[None, :] < TOPK)
    flat = rm[:, None] * KP + kk[None, :]
    key = tl.where(valid, top_e * NP + pair, E * NP + flat)
    tl.store(key_ptr + flat, key)
    tl.store(wflat_ptr + pair, top_w, mask=valid)
    tl.debug_barrier()
    s = tl.arange(0, NP)
    ks = tl.sort(tl.load(key_ptr + s))
    e_s = ks // NP
    i_s = ks % NP
    ok = e_s < E
    tl.store(e_ptr + s, e_s)
    tl.debug_barrier()
    prev = tl.load(e_ptr + s - 1, mask=s > 0, other=-1)
    nxt = tl.load(e_ptr + s + 1, mask=s + 1 < NP, other=-1)
    first = ok & (e_s != prev)
    last = ok & (e_s != nxt)
    gid = tl.cumsum(first.to(tl.int32), 0) - 1
    tl.store(gexp_ptr + gid, e_s, mask=first)
    tl.store(gstart_ptr + gid, s, mask=first)
    tl.store(gend_ptr + gid, s + 1, mask=last)
    tl.store(ng_ptr, tl.sum(first.to(tl.int32), 0))
    tl.store(perm_ptr + s, i_s, mask=ok)
    tl.store(w_ptr + s, tl.load(wflat_ptr + i_s, mask=ok, other=0.0), mask=ok)
    tl.store(inv_ptr + i_s, s, mask=ok)


@triton.jit
def _moe_gemm_kernel(
    x_ptr, w_ptr, y_ptr, perm_ptr, rw_ptr, gexp_ptr, gstart_ptr, gend_ptr, ng_ptr,
    N, K,
    TOPK: tl.constexpr, GATHER: tl.constexpr, SILU_MUL: tl.constexpr, SCALE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    # Program (g, n): the rows routed to the g-th distinct expert × BN output columns.
    # Groups past the number of distinct experts exit at once, so the weight bytes read
    # follow the experts actually touched.
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    if g < tl.load(ng_ptr):
        e = tl.load(gexp_ptr + g).to(tl.int64)
        s0 = tl.load(gstart_ptr + g)
        s1 = tl.load(gend_ptr + g)
        rs = s0 + tl.arange(0, BM)
        r_ok = rs < s1
        if GATHER:  # rows of x are tokens: the sorted pair's token
            xr = tl.load(perm_ptr + rs, mask=r_ok, other=0) // TOPK
        else:  # rows of x are already in sorted-pair order
            xr = rs
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        rk = tl.arange(0, BK)
        if SILU_MUL:
            w_rows = w_ptr + e * (2 * N * K) + rn[:, None].to(tl.int64) * K
        else:
            w_rows = w_ptr + e * (N * K) + rn[:, None].to(tl.int64) * K
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + xr[:, None].to(tl.int64) * K + (k0 + rk)[None, :], mask=r_ok[:, None], other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
            if SILU_MUL:
                wu = tl.load(w_rows + N * K + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
                acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PREC)
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if SCALE:
            acc = acc * tl.load(rw_ptr + rs, mask=r_ok, other=0.0)[:, None]
        tl.store(y_ptr + rs[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(
    y_ptr, inv_ptr, r_ptr, out_ptr, sh_ptr, sg_ptr, N, stride_rm,
    TOPK: tl.constexpr, SHARED: tl.constexpr, BN: tl.constexpr,
):
    # out[m] = residual[m] + Σ_j y[pair (m, j)] (+ sigmoid(gate[m]) · shared[m]), summed in
    # top-k order, so a token's result does not depend on the other tokens.
    m = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = rn < N
    acc = tl.zeros((BN,), tl.float32)
    for j in tl.static_range(TOPK):
        s = tl.load(inv_ptr + m * TOPK + j).to(tl.int64)
        acc += tl.load(y_ptr + s * N + rn, mask=ok, other=0.0).to(tl.float32)
    if SHARED:
        gate = tl.load(sg_ptr + m).to(tl.float32)
        acc += tl.load(sh_ptr + m * N + rn, mask=ok, other=0.0).to(tl.float32) / (1.0 + tl.exp(-gate))
    acc += tl.load(r_ptr + m * stride_rm + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_rm + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


class Routing:
    """Device-side routing of M tokens: pairs sorted by expert, in static-size buffers."""

    def __init__(self, M: int, top_k: int, n_experts: int, device, n_groups: torch.Tensor | None = None):
        kp = triton.next_power_of_2(top_k)
        # At least 16 rows: the softmax reductions keep one layout (one rounding) for M <= 16.
        self.bm = max(16, triton.next_power_of_2(M))
        np_ = self.bm * kp
        i32 = dict(dtype=torch.int32, device=device)
        self.M, self.top_k, self.kp = M, top_k, kp
        self.max_groups = min(n_experts, M * top_k)
        self.key = torch.empty(np_, **i32)
        self.e_sorted = torch.empty(np_, **i32)
        self.w_flat = torch.empty(M * top_k, dtype=torch.float32, device=device)
        self.weights = torch.empty(M * top_k, dtype=torch.float32, device=device)  # per sorted pair
        self.perm = torch.empty(M * top_k, **i32)  # sorted pair → pair index (token · top_k + j)
        self.inv = torch.empty(M * top_k, **i32)  # pair index → sorted position
        self.gexp = torch.empty(self.max_groups, **i32)
        self.gstart = torch.empty(self.max_groups, **i32)
        self.gend = torch.empty(self.max_groups, **i32)
        # distinct experts touched: a caller-provided int32 slot, so no copy is needed to keep it
        self.n_groups = n_groups if n_groups is not None else torch.empty(1, **i32)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, n_groups: torch.Tensor | None = None) -> Routing:
    M, E = logits.shape
    r = Routing(M, top_k, E, logits.device, n_groups)
    _moe_route_kernel[(1,)](
        logits, r.key, r.e_sorted, r.w_flat, r.weights, r.perm, r.inv, r.gexp, r.gstart, r.gend, r.n_groups,
        M, E, TOPK=top_k, KP=r.kp, BM=r.bm, BE=triton.next_power_of_2(E), NORM_TOPK=norm_topk_prob, num_warps=4,
    )
    return r


def moe_experts(xn: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, r: Routing,
                config_up=None, config_down=None) -> torch.Tensor:
    """xn [M, H] normalized tokens; gate_up [E, 2I, H]; down [E, H, I] → y [M·top_k, H]
    fp32, one row per sorted pair, already scaled by its routing weight."""
    M, H = xn.shape
    E, I2, _ = gate_up.shape
    inter = I2 // 2
    P = M * r.top_k
    prec = "ieee" if xn.dtype == torch.float32 else "tf32"
    bm = m_tile(M)
    # Column tiles sized so that (distinct experts possible) × tiles fills the SMs. The tile
    # width does not change the order of a row's sum over K (that is fixed by BK steps).
    groups = max(1, r.max_groups)
    bn, bk, warps, stages = fit_smem(bm, *(config_up or linear_config(inter, H, bm, sms=132 // groups))[:4],
                                     weight_tiles=2, elt=xn.element_size())
    h = torch.empty((P, inter), dtype=xn.dtype, device=xn.device)
    _moe_gemm_kernel[(r.max_groups, triton.cdiv(inter, bn))](
        xn, gate_up, h, r.perm, r.weights, r.gexp, r.gstart, r.gend, r.n_groups, inter, H,
        TOPK=r.top_k, GATHER=True, SILU_MUL=True, SCALE=False, BM=bm, BN=bn, BK=bk, PREC=prec,
        num_warps=warps, num_stages=stages,
    )
    bn, bk, warps, stages = fit_smem(bm, *(config_down or linear_config(H, inter, bm, sms=132 // groups))[:4],
                                     elt=xn.element_size())
    y = torch.empty((P, H), dtype=torch.float32, device=xn.device)
    _moe_gemm_kernel[(r.max_groups, triton.cdiv(H, bn))](
        h, down, y, r.perm, r.weights, r.gexp, r.gstart, r.gend, r.n_groups, H, inter,
        TOPK=r.top_k, GATHER=False, SILU_MUL=False, SCALE=True, BM=bm, BN=bn, BK=bk, PREC=prec,
        num_warps=warps, num_stages=stages,
    )
    return y


def moe_combine(y: torch.Tensor, r: Routing, residual: torch.Tensor, out=None, shared=None, shared_gate=None):
    M, N = residual.shape
    out = residual if out is None else out
    BN = 256
    _moe_combine_kernel[(M, triton.cdiv(N, BN))](
        y, r.inv, residual, out, shared if shared is not None else y, shared_gate if shared_gate is not None else y,
        N, residual.stride(0), TOPK=r.top_k, SHARED=shared is not None, BN=BN, num_warps=4,
    )
    return out

"""The Triton kernels of the GPU forward against plain torch references.

Without a GPU they run in Triton's interpreter in fp32 (tight tolerances); on a GPU the
same tests run in bf16 (tolerances of bf16 rounding)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:  # importing it here would fix the mode too early
    pytest.skip("triton is not installed", allow_module_level=True)
from specscope.models import kernels as K  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-5


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rms(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("M", [1, 20])
def test_linear_variants(M):
    g = torch.Generator().manual_seed(M)
    Kd, N = 128, 96
    x = torch.randn(M, Kd, generator=g).to(DEV, DT)
    w = (torch.randn(2 * N, Kd, generator=g) * 0.1).to(DEV, DT)
    b = torch.randn(2 * N, generator=g).to(DEV, DT)
    nw = torch.rand(Kd, generator=g).to(DEV, DT) + 0.5
    res = torch.randn(M, N, generator=g).to(DEV, DT)
    assert rel_err(K.linear(x, w), x.float() @ w.float().T) < TOL
    assert rel_err(K.linear(x, w, bias=b), x.float() @ w.float().T + b.float()) < TOL
    xn = torch.empty_like(x)
    ref_n = rms(x, nw, 1e-5)
    y = K.linear(x, w, norm=nw, eps=1e-5, xn_out=xn)
    assert rel_err(y, ref_n @ w.float().T) < TOL
    assert rel_err(xn, ref_n) < TOL
    h = ref_n @ w.float().T
    y = K.linear(x, w, norm=nw, eps=1e-5, silu_mul=True)
    assert y.shape == (M, N)
    assert rel_err(y, F.silu(h[:, :N]) * h[:, N:]) < TOL
    y = K.linear(x, w[:N], residual=res, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and rel_err(y, x.float() @ w[:N].float().T + res.float()) < TOL
    # in place on the residual stream, and strided input rows (last token of each sequence)
    r2 = res.clone()
    K.linear(x, w[:N], residual=r2, out=r2)
    assert rel_err(r2, x.float() @ w[:N].float().T + res.float()) < TOL
    xs = torch.randn(M, 3, Kd, generator=g).to(DEV, DT)
    assert rel_err(K.linear(xs[:, -1], w), xs[:, -1].float() @ w.float().T) < TOL


@pytest.mark.parametrize("split", [2, 4])
def test_linear_split_k(split):
    # Split-K: parts write fp32 partials, the last to arrive reduces them in order.
    g = torch.Generator().manual_seed(split)
    M, Kd, N = 3, 256, 48
    x = torch.randn(M, Kd, generator=g).to(DEV, DT)
    w = (torch.randn(2 * N, Kd, generator=g) * 0.1).to(DEV, DT)
    nw = torch.rand(Kd, generator=g).to(DEV, DT) + 0.5
    res = torch.randn(M, N, generator=g).to(DEV, DT)
    cfg = (16, 32, 4, 2, split)
    h = rms(x, nw, 1e-5) @ w.float().T
    y = K.linear(x, w, norm=nw, eps=1e-5, silu_mul=True, config=cfg)
    assert rel_err(y, F.silu(h[:, :N]) * h[:, N:]) < TOL
    r2 = res.clone()
    K.linear(x, w[:N], residual=r2, out=r2, config=cfg)
    assert rel_err(r2, x.float() @ w[:N].float().T + res.float()) < TOL
    again = res.clone()
    K.linear(x, w[:N], residual=again, out=again, config=cfg)  # counters were left at zero
    assert torch.equal(again, r2)


def test_linear_rows_do_not_depend_on_m():
    # A row's result is bitwise the same whatever the other rows (M <= 16): greedy
    # decode (T = 1) and verify (T <= 16) see the same logits.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g).to(DEV, DT)
    w = torch.randn(64, 256, generator=g).to(DEV, DT)
    full = K.linear(x, w)
    for m in (1, 3, 8):
        assert torch.equal(K.linear(x[:m].contiguous(), w), full[:m])


def make_cache(S, Hkv, L, D, g):
    return (torch.randn(S, Hkv, L, D, generator=g).to(DEV, DT), torch.randn(S, Hkv, L, D, generator=g).to(DEV, DT))


def rope_ref(x, cos, sin):  # x [..., D]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("qk_norm,tree", [(False, False), (True, False), (False, True)])
def test_rope_store(qk_norm, tree):
    g = torch.Generator().manual_seed(1)
    B, T, H, Hkv, D, L = 2, 3, 4, 2, 16, 40
    qkv = torch.randn(B * T, (H + 2 * Hkv) * D, generator=g).to(DEV, DT)
    ang = torch.rand(L, D // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(DEV, DT)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(DEV, DT)
    positions = torch.tensor([[5, 6, 7], [20, 21, 21]] if tree else [[5, 6, 7], [20, 21, 22]], device=DEV)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    nvalid = torch.tensor([2], dtype=torch.int32, device=DEV)  # the third row is padding
    kc, vc = make_cache(3, Hkv, L, D, g)
    kc0, vc0 = kc.clone(), vc.clone()
    qn = (torch.rand(D, generator=g) + 0.5).to(DEV, DT) if qk_norm else None
    kn = (torch.rand(D, generator=g) + 0.5).to(DEV, DT) if qk_norm else None
    q = K.rope_store(qkv, cos, sin, positions, slots, nvalid, kc, vc, n_heads=H, n_kv=Hkv, head_dim=D,
                     q_norm=qn, k_norm=kn, eps=1e-6, tree=tree)
    x = qkv.float().view(B, T, H + 2 * Hkv, D)
    qr, kr, vr = x[:, :, :H], x[:, :, H:H + Hkv], x[:, :, H + Hkv:]
    if qk_norm:
        qr, kr = rms(qr, qn, 1e-6), rms(kr, kn, 1e-6)
    c, s = cos.float()[positions][:, :, None], sin.float()[positions][:, :, None]
    assert rel_err(q.view(B, T, H, D), rope_ref(qr, c, s)) < TOL
    kr = rope_ref(kr, c, s)
    for b in range(B):
        for t in range(T):
            idx = (positions[b, 0] + t) if tree else positions[b, t]
            sl = slots[b]
            if t < 2:
                assert rel_err(kc[sl, :, idx], kr[b, t]) < TOL
                assert rel_err(vc[sl, :, idx], vr[b, t]) < TOL
            else:  # padding rows leave the cache alone
                assert torch.equal(kc[sl, :, idx], kc0[sl, :, idx]) and torch.equal(vc[sl, :, idx], vc0[sl, :, idx])


def attn_ref(q, kc, vc, slots, positions, nvalid, tree_mask):
    B, T = positions.shape
    H, D = q.shape[-1] // kc.shape[-1], kc.shape[-1]
    Hkv = kc.shape[1]
    out = torch.zeros(B, T, H, D)
    for b in range(B):
        start = int(positions[b, 0])
        L = start + T
        keys = kc[slots[b], :, :L].float().repeat_interleave(H // Hkv, 0)
        vals = vc[slots[b], :, :L].float().repeat_interleave(H // Hkv, 0)
        vis = torch.zeros(T, L, dtype=torch.bool)
        vis[:, :start] = True
        for t in range(T):
            for j in range(T):
                if j < nvalid and (tree_mask[b, t, j] if tree_mask is not None else j <= t):
                    vis[t, start + j] = True
        qb = q.view(B, T, H, D)[b].float().transpose(0, 1)  # [H, T, D]
        att = (qb @ keys.transpose(1, 2)) / D ** 0.5
        att = att.masked_fill(~vis, float("-inf")).softmax(-1)
        out[b] = (att @ vals).transpose(0, 1)
    return out.view(B * T, H * D)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("T,start", [(1, 0), (4, 63), (9, 130)])
def test_attention(T, start, tree):
    g = torch.Generator().manual_seed(T + start)
    B, H, Hkv, D, L = 2, 8, 2, 16, 200
    kc, vc = make_cache(3, Hkv, L, D, g)
    q = torch.randn(B * T, H * D, generator=g).to(DEV, DT)
    positions = torch.stack([torch.arange(start, start + T), torch.arange(start + 7, start + 7 + T)]).to(DEV)
    slots = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    nvalid = torch.tensor([T], dtype=torch.int32, device=DEV)
    tree_mask = None
    if tree:
        parents = torch.randint(-1, 1, (T,), generator=g)
        m = torch.eye(T, dtype=torch.bool)
        for i in range(1, T):  # random tree: each node's parent is an earlier node or the root
            p = int(torch.randint(0, i, (1,), generator=g))
            m[i] |= m[p]
        del parents
        tree_mask = m[None].expand(B, T, T).to(torch.int8).contiguous().to(DEV)
    out = K.attention(q, kc, vc, slots, positions, nvalid, n_heads=H, n_kv=Hkv, head_dim=D, tree_mask=tree_mask)
    ref = attn_ref(q.cpu(), kc.cpu(), vc.cpu(), slots.cpu(), positions.cpu(), T,
                   tree_mask.cpu() if tree_mask is not None else None)
    assert rel_err(out.cpu(), ref) < TOL


def moe_ref(xn, gate_up, down, logits, top_k, norm):
    p = logits.float().softmax(-1)
    w, e = p.topk(top_k, -1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(xn.shape[0], down.shape[1])
    for m in range(xn.shape[0]):
        for j in range(top_k):
            gu = gate_up[e[m, j]].float() @ xn[m].float()
            h = F.silu(gu[: gu.shape[0] // 2]) * gu[gu.shape[0] // 2:]
            out[m] += w[m, j] * (down[e[m, j]].float() @ h)
    return out, e


@pytest.mark.parametrize("M,norm", [(1, True), (6, False), (20, True)])
def test_moe_route_experts_combine(M, norm):
    g = torch.Generator().manual_seed(M)
    E, top_k, H, I = 16, 4, 64, 32
    xn = torch.randn(M, H, generator=g).to(DEV, DT)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(DEV, DT)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(DEV, DT)
    logits = torch.randn(M, E, generator=g).to(DEV, torch.float32)
    res = torch.randn(M, H, generator=g).to(DEV, DT)
    r = K.moe_route(logits, top_k, norm)
    ref, experts = moe_ref(xn.cpu(), gate_up.cpu(), down.cpu(), logits.cpu(), top_k, norm)
    assert int(r.n_groups) == len(set(experts.flatten().tolist()))
    y = K.moe_experts(xn, gate_up, down, r)
    out = K.moe_combine(y, r, res.clone())
    assert rel_err(out.cpu(), ref + res.float().cpu()) < TOL

"""``quant_step``'s general path (steps with prefill chunks, and every step without windows) rotates q, k, v and
unrotates the output with the ``rotate_rows`` op (one launch per tensor on CUDA). Pinned here to the float32
reference path it replaced (``rotate_rows_ref`` products, then ``.to`` casts): bit for bit on CPU, where the op is
that reference, for outputs, 2-bit pages and 16-bit rings; and through the Triton kernel in the interpreter (the
root conftest sets it before any kernel import)."""

import pytest
import torch
import vllm_sim
from vllm_sim import NO_WINDOWS, SINK_ONLY, WINDOWS, Sim

import oscarkv.integrations.vllm.core as core
from oscarkv.kernels.layout import QuantPages
from oscarkv.kernels.reference import rotate_rows_ref

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TIERS = {"windows": WINDOWS, "sink_only": SINK_ONLY, "no_windows": NO_WINDOWS}
# decodes first; chunks with and without a stored prefix, two chunks in one step, decode-only steps between
STEPS = [[("a", 40)], [("a", 1), ("b", 23)], [("a", 1), ("b", 1), ("c", 45)], [("a", 1), ("b", 1), ("c", 1)],
         [("a", 1), ("b", 1), ("c", 1)], [("a", 1), ("c", 1), ("b", 33)], [("b", 1), ("a", 7), ("d", 18)]]
OUT_KINDS = [None, "act", F32, F16, BF16, "strided"]  # out=None: float32 result; "strided": a [..., d:] view
NAMES = {BF16: "bf16", F16: "f16", F32: "f32"}


def dtype_pairs(*pairs):
    """(activation dtype, dtype16) parameters, named e.g. ``act_bf16-tiers_f32``."""
    return [pytest.param(a, b, id=f"act_{NAMES[a]}-tiers_{NAMES[b]}") for a, b in pairs]


def old_general_path(q, k, v, kv, pools, p, m, out=None):
    """The general path of ``quant_step`` as it was before it used the ``rotate_rows`` op (verbatim but for the
    causal_self_attention / unrotate_rows names): float32 rotations by ``rotate_rows_ref``, then casts."""
    quantize_write, decode_attention, extend_attention, _ = core.ops()
    T, nd, act = m.num_tokens, m.num_decodes, q.dtype
    kp, vp = kv
    qr = rotate_rows_ref(q, p.r_k).to(act)
    kr, vr = rotate_rows_ref(k, p.r_k, p.mu_k), rotate_rows_ref(v, p.r_v, p.mu_v)
    k16new, v16new = kr.to(p.dtype16), vr.to(p.dtype16)
    kr, vr = kr.to(act), vr.to(act)
    H, d = k.shape[1], k.shape[2]
    empty16 = q.new_zeros(1, H, 1, d)
    pre16 = {}
    if pools is not None:
        flat_k, flat_v = (pool.view(-1, *pool.shape[2:]) for pool in pools)
        for row, _, _, n0 in m.prefills:
            if n0:
                pre16[row] = (flat_k[m.gather[row]].permute(1, 0, 2)[None],
                              flat_v[m.gather[row]].permute(1, 0, 2)[None])
    quantize_write(kp, vp, k16new, v16new, m.slot_mapping, k_clip=p.k_clip, v_clip=p.v_clip)
    if pools is not None:
        flat_k.index_copy_(0, m.ring_dst, k16new[m.ring_keep])
        flat_v.index_copy_(0, m.ring_dst, v16new[m.ring_keep])
    attn = torch.empty(T, q.shape[1], q.shape[2], dtype=act, device=q.device)
    if nd and pools is not None:
        k16 = flat_k[m.gather[:nd]].permute(0, 2, 1, 3)
        v16 = flat_v[m.gather[:nd]].permute(0, 2, 1, 3)
        decode_attention(qr[:nd], kp, vp, m.bt2[:nd], m.qlen[:nd], k16, v16, m.len16[:nd], p.sm_scale, plan=m.plan,
                         out=attn[:nd])
    elif nd:
        z = empty16.expand(nd, H, 1, d)
        extend_attention(qr[:nd, None], kr[:nd, None], vr[:nd, None], kp, vp, m.bt2[:nd], m.qlen[:nd], z, z,
                         m.len16[:nd], p.sm_scale, out=attn[:nd, None])
    for row, a, b, n0 in m.prefills:
        if n0 == 0 and q.is_cuda:
            attn[a:b] = core.causal_self_attention(qr[a:b], kr[a:b], vr[a:b], p.sm_scale)
            continue
        k16, v16 = pre16.get(row, (empty16, empty16))
        hl = ([m.qlen_host[row]], [m.len16_host[row]]) if m.qlen_host else None
        extend_attention(qr[None, a:b], kr[None, a:b], vr[None, a:b], kp, vp, m.bt2[row:row + 1],
                         m.qlen[row:row + 1], k16, v16, m.len16[row:row + 1], p.sm_scale, out=attn[None, a:b],
                         host_lengths=hl)
    res = rotate_rows_ref(attn, p.r_v, p.mu_v, transpose=True, mean_after=True)  # = unrotate_rows(attn, p)
    return res if out is None else out.copy_(res)


def clone_state(kv, pools):
    return (tuple(QuantPages(x.codes.clone(), x.scale.clone(), x.offset.clone(), x.fmt) for x in kv),
            None if pools is None else tuple(x.clone() for x in pools))


def out_buffer(kind, q):
    if kind is None:
        return None
    if kind == "strided":
        return torch.full((*q.shape[:2], 2 * q.shape[2]), float("nan"), dtype=BF16)[..., q.shape[2]:]
    return torch.full(q.shape, float("nan"), dtype=q.dtype if kind == "act" else kind)


def assert_bits_equal(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), what


def assert_state_equal(kv, pools, kv_want, pools_want, what):
    for side, a, b in zip("KV", kv, kv_want):
        for name in ("codes", "scale", "offset"):
            assert_bits_equal(getattr(a, name), getattr(b, name), f"{what}: {side} {name}")
    for side, a, b in zip("KV", pools or (), pools_want or ()):
        assert_bits_equal(a, b, f"{what}: {side} 16-bit pool")


class Twin:
    """Stands in for ``quant_step`` in :meth:`Sim.step`: inputs cast to ``act``; the old path on a copy of the
    Sim's cache, the new one on the Sim's cache (and once more per other ``out`` kind, on copies); everything
    they return or write must be bit-identical."""

    def __init__(self, act):
        self.act, self.general = act, 0

    def __call__(self, q, k, v, kv, pools, p, m, out=None):
        assert out is None
        q, k, v = (x.to(self.act) for x in (q, k, v))
        general = pools is None or bool(m.prefills)
        self.general += general
        start = clone_state(kv, pools)
        kinds = OUT_KINDS if general else [None]
        for i, kind in enumerate(kinds):
            kv_old, pools_old = clone_state(*start)
            want = (old_general_path if general else core.quant_step)(q, k, v, kv_old, pools_old, p, m,
                                                                      out=out_buffer(kind, q))
            kv_new, pools_new = (kv, pools) if i == 0 else clone_state(*start)
            buf = out_buffer(kind, q)
            got = core.quant_step(q, k, v, kv_new, pools_new, p, m, out=buf)
            what = f"act {self.act}, dtype16 {p.dtype16}, out {kind}, prefills {m.prefills}, decodes {m.num_decodes}"
            assert buf is None or got is buf, what
            assert_bits_equal(got, want, what)
            assert_state_equal(kv_new, pools_new, kv_old, pools_old, what)
            if i == 0:
                res = got
        return res.float()


def make_sim(tiers, dtype16):
    sim = Sim(tiers)
    sim.p.dtype16 = dtype16
    if sim.pools is not None:
        sim.pools = tuple(torch.zeros_like(x, dtype=dtype16) for x in sim.pools)
    return sim


@pytest.mark.slow  # 24 cases of 16-bit CPU numerics: minutes on 2 cores
@pytest.mark.parametrize("tiers", list(TIERS), ids=list(TIERS))
# every dtype as activations and as 16-bit tiers, equal and narrower/wider tiers than activations
@pytest.mark.parametrize("act,dtype16", dtype_pairs((BF16, BF16), (F32, F32), (F32, BF16), (BF16, F32), (BF16, F16)))
def test_general_path_equals_old_float32_reference_path(monkeypatch, tiers, act, dtype16):
    """Mixed steps (prefill chunks + decodes), with and without windows, dtype16 equal to and different from the
    activation dtype, every kind of output buffer: outputs, pages and rings bit-identical to the old path."""
    twin = Twin(act)
    monkeypatch.setattr(vllm_sim, "quant_step", twin)
    sim = make_sim(TIERS[tiers], dtype16)
    for batch in STEPS:
        sim.step(batch)
    assert twin.general == (len(STEPS) if tiers == "no_windows" else 5)


class Counting:
    """``quant_step`` with inputs cast to ``act`` and ``ops()``'s rotate_rows recorded (``core.rotate_rows_ref``
    raises: the general path must not run its own float32 rotations)."""

    def __init__(self, monkeypatch, act):
        self.act, self.calls, self.steps = act, [], []
        real = core.ops()

        def rotate_rows(x, r, mu=None, **kw):
            self.calls.append((x, kw))
            return real[3](x, r, mu, **kw)

        def no_ref(*a, **k):
            raise AssertionError("quant_step ran rotate_rows_ref directly")

        monkeypatch.setattr(core, "ops", lambda: (*real[:3], rotate_rows))
        monkeypatch.setattr(core, "rotate_rows_ref", no_ref)

    def __call__(self, q, k, v, kv, pools, p, m, out=None):
        q, k, v = (x.to(self.act) for x in (q, k, v))
        self.calls = []
        out = out_buffer(F16, q) if len(self.steps) % 2 else None
        res = core.quant_step(q, k, v, kv, pools, p, m, out=out)
        self.steps.append((bool(m.prefills), out, res, self.calls))
        return res.float()


@pytest.mark.parametrize("act,dtype16", dtype_pairs((BF16, BF16), (F32, BF16), (BF16, F32)))
def test_general_path_rotates_with_four_rotate_rows_calls(monkeypatch, act, dtype16):
    """q, k, v and the output: one rotate_rows call each, outputs written in their final dtypes (no float32 tensor
    unless the result itself is float32), the result straight into ``out``."""
    counting = Counting(monkeypatch, act)
    monkeypatch.setattr(vllm_sim, "quant_step", counting)
    sim = make_sim(TIERS["windows"], dtype16)
    for batch in STEPS:
        sim.step(batch)
    general = [s for s in counting.steps if s[0]]
    assert len(general) == 5 and any(s[1] is not None for s in general) and any(s[1] is None for s in general)
    for _, out, res, calls in general:
        assert len(calls) == 4
        (xq, kq), (xk, kk), (xv, kv), (xo, ko) = calls
        assert kq["out"].dtype == act and kq.get("rows_out") is None and not kq.get("transpose")
        for kw in (kk, kv):
            assert kw["out"].dtype == act and not kw.get("transpose")
            if dtype16 == act:
                assert kw.get("rows_out") is None
            else:  # the same products rounded to dtype16, every row (the rows to quantize)
                assert kw["rows_out"].dtype == dtype16 and kw["rows"].tolist() == list(range(xk.shape[0]))
        assert ko["transpose"] and ko["mean_after"] and ko["out"] is res and xo.dtype == act
        if out is not None:
            assert res is out and res.dtype == F16
        else:
            assert res.dtype == F32


@pytest.mark.interpret
def test_general_path_through_the_triton_rotate_kernel(monkeypatch):
    """The Triton rotate_rows kernel (interpreter on CPU; the other ops the reference) through quant_step's general
    and decode paths against the old float32 reference path, each step from the same cache. Tolerances: output
    relative Frobenius error < 1e-5 with float32 activations and tiers, < 1e-2 with float32 activations and
    bfloat16 tiers, < 2.5e-2 with 16-bit activations (the interpreter truncates float32 -> bfloat16, the GPU
    rounds); 16-bit ring rows within one ulp (2^-7 relative), float32 rings within 1e-5 of their largest value;
    under 0.5 % of the 2-bit code bytes different (0.01 % in float32)."""
    pytest.importorskip("triton")
    from oscarkv.kernels import dispatch
    from oscarkv.kernels.rotate_triton import rotate_rows_triton

    calls = [0]

    def rotate(*a, **kw):
        calls[0] += 1
        return rotate_rows_triton(*a, **kw)

    triton_ops = (dispatch.quantize_write, dispatch.decode_attention, dispatch.extend_attention, rotate)
    ref_ops = core.ops()
    worst = {}
    for act, dtype16 in [(BF16, BF16), (F32, BF16), (F16, BF16), (F32, F32)]:
        for name in ("windows", "no_windows"):
            def twin(q, k, v, kv, pools, p, m, out=None, act=act, dtype16=dtype16, name=name):
                q, k, v = (x.to(act) for x in (q, k, v))
                kv_old, pools_old = clone_state(kv, pools)
                monkeypatch.setattr(core, "ops", lambda: ref_ops)
                old = old_general_path if pools is None or m.prefills else core.quant_step  # decode-only: _decode_step
                want = old(q, k, v, kv_old, pools_old, p, m)
                monkeypatch.setattr(core, "ops", lambda: triton_ops)
                got = core.quant_step(q, k, v, kv, pools, p, m)
                w = worst.setdefault((act, dtype16, name), [0.0] * 4)
                w[0] = max(w[0], ((got - want).norm() / want.norm()).item())
                for a, b in zip(pools or (), pools_old or ()):
                    a, b = a.double(), b.double()
                    top = b.abs().max()
                    w[1] = max(w[1], ((a - b).abs() / b.abs().clamp_min(1e-3 * top)).max().item())  # in 16-bit ulps
                    w[2] = max(w[2], ((a - b).abs().max() / top).item())
                for a, b in zip(kv, kv_old):
                    w[3] = max(w[3], (a.codes != b.codes).float().mean().item())
                for a, b in zip(kv, kv_old):  # the next step starts from the reference's cache: no drift
                    for f in ("codes", "scale", "offset"):
                        getattr(a, f).copy_(getattr(b, f))
                for a, b in zip(pools or (), pools_old or ()):
                    a.copy_(b)
                return got
            monkeypatch.setattr(vllm_sim, "quant_step", twin)
            sim = make_sim(TIERS[name], dtype16)
            for batch in STEPS:
                sim.step(batch)
    for (act, dtype16, name), (out_err, ring_ulp, ring_err, code_frac) in worst.items():
        # the interpreter casts float32 -> bfloat16 by truncation (the GPU rounds to nearest): bfloat16 results are
        # one ulp off the reference's in about half the elements, float16 ones (rounded) in a few percent
        out_tol = 1e-5 if act == dtype16 == F32 else 1e-2 if act == F32 else 2.5e-2
        assert out_err < out_tol, (act, dtype16, name, out_err)
        if dtype16 == F32:
            assert ring_err < 1e-5, (act, dtype16, name, ring_err)
        else:  # within one 16-bit ulp (2^-7 relative for bfloat16), away from values near zero
            assert ring_ulp <= 2.0 ** -7, (act, dtype16, name, ring_ulp)
        assert code_frac < (1e-4 if act == dtype16 == F32 else 5e-3), (act, dtype16, name, code_frac)
    assert calls[0] >= 4 * (5 + len(STEPS)) * 4, calls

"""Triton device functions of the extend kernel (:mod:`oscarkv.kernels.extend_triton`): code tiles unpacked to
exact 16-bit codes or dequantized to float16 by inline PTX on CUDA (integer ops in the interpreter), the four
field tiles as one natural-order operand, the online-softmax step and the (optionally lazy) accumulator rescale,
the logits over a channel page, and the flash step of the dense kernel (:mod:`oscarkv.kernels.extend_dense`).
Field ``j`` of packed byte ``c`` is element ``j d/4 + c`` of the row, so a ``[n, d/4]`` field tile is the column
block ``[j d/4, (j+1) d/4)``."""

from __future__ import annotations

import triton
import triton.language as tl

def _unpack_asm(bf16: bool) -> str:
    """Inline PTX: four 2-bit fields of four packed bytes -> four pairs of exact 16-bit codes (field j of bytes
    0..3). prmt spreads bytes 0/1 (2/3) into the two halves; lop3 ORs field j, left where it is (4^j c), into the
    mantissa of the bias (1024 in float16, 128 in bfloat16: ulp 1); one fma scales by 4^-j and removes the bias
    (exact), so there are no shifts. In bfloat16 bit 7 is the exponent's, so field 3 is shifted down once."""
    one, bias = ("0x3f803f80", "0x43004300") if bf16 else ("0x3c003c00", "0x64006400")
    # per field: (mask, scale 4^-j, -bias 4^-j) as packed 16-bit pairs
    fields = ([("0x00030003", one, "0xc300c300"), ("0x000c000c", "0x3e803e80", "0xc200c200"),
               ("0x00300030", "0x3d803d80", "0xc100c100"), ("0x00300030", "0x3d803d80", "0xc100c100")] if bf16 else
              [("0x00030003", one, "0xe400e400"), ("0x000c000c", "0x34003400", "0xdc00dc00"),
               ("0x00300030", "0x2c002c00", "0xd400d400"), ("0x00c000c0", "0x24002400", "0xcc00cc00")])
    fma = "fma.rn.bf16x2" if bf16 else "fma.rn.f16x2"
    lines = ["{", ".reg .b32 a, b, t, u, k, m, s, o;", "prmt.b32 a, $8, 0, 0x4140;", "prmt.b32 b, $8, 0, 0x4342;",
             f"mov.b32 k, {bias};"]
    for j, (mask, scale, off) in enumerate(fields):
        lines += [f"mov.b32 m, {mask};", f"mov.b32 s, {scale};", f"mov.b32 o, {off};"]
        src_a, src_b = "a", "b"
        if bf16 and j == 3:
            lines += ["shr.b32 t, a, 2;", "shr.b32 u, b, 2;"]
            src_a, src_b = "t", "u"
        for reg, src in ((2 * j, src_a), (2 * j + 1, src_b)):
            lines += [f"lop3.b32 ${reg}, {src}, m, k, 0xea;", f"{fma} ${reg}, ${reg}, s, o;"]
    return "\n".join(lines + ["}"])


_UNPACK_F16 = tl.constexpr(_unpack_asm(False))
_UNPACK_BF16 = tl.constexpr(_unpack_asm(True))


def _dequant_asm() -> str:
    """As :func:`_unpack_asm` (float16), then one more fma per pair: ``code * s + o`` with the row's scale and
    offset (operands $9/$10 and $11/$12, float16 pairs), rounded once: the dequantized float16 tile."""
    base = _unpack_asm(False).splitlines()
    out = []
    for line in base:
        out.append(line)
        if line.startswith("fma.rn.f16x2 $"):
            reg = int(line.split("$")[1].split(",")[0])
            sc, of = ("$9", "$11") if reg % 2 == 0 else ("$10", "$12")
            out.append(f"fma.rn.f16x2 ${reg}, ${reg}, {sc}, {of};")
    return "\n".join(out)


_DEQUANT_F16 = tl.constexpr(_dequant_asm())


@triton.jit
def _query_rows(q_ptr, sq_b, sq_t, sq_h, T, HKV, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's geometry (grid ``(query blocks, B * Hkv)``): sequence ``b``, KV head ``h``, and its
    ``BLOCK_M`` rows, (token ``tq``, query head ``hq`` of ``h``'s GQA group) pairs, valid where ``rmask``, with
    their row pointers ``qrow`` into ``q [B, T, Hq, d]``."""
    TOK_M: tl.constexpr = BLOCK_M // G
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, BLOCK_M)
    tq = tl.program_id(0) * TOK_M + r // G
    hq = h * G + r % G
    rmask = (tq < T) & (r < TOK_M * G)
    qrow = q_ptr + b.to(tl.int64) * sq_b + tq.to(tl.int64)[:, None] * sq_t + hq[:, None] * sq_h
    return b, h, tq, hq, rmask, qrow


@triton.jit
def _unpack4(codes, CBF: tl.constexpr, ASM: tl.constexpr, OUT: tl.constexpr):
    """The four 2-bit fields of uint8 ``codes`` as exact codes, field ``j`` = column block ``j`` of the rows.
    With ``ASM`` (CUDA): float16 (``CBF=0``) or bfloat16 (``CBF=1``) by magic-number unpacking; otherwise
    integer ops converted to ``OUT`` (the interpreter, which runs the dots in float32)."""
    if ASM:
        if CBF:
            f0, f1, f2, f3 = tl.inline_asm_elementwise(
                _UNPACK_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r", [codes],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            f0, f1, f2, f3 = tl.inline_asm_elementwise(
                _UNPACK_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r", [codes],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        x = codes.to(tl.int32)
        f0 = (x & 3).to(OUT)
        f1 = ((x >> 2) & 3).to(OUT)
        f2 = ((x >> 4) & 3).to(OUT)
        f3 = ((x >> 6) & 3).to(OUT)
    return f0, f1, f2, f3


@triton.jit
def _dequant4(codes, sc, of, ASM: tl.constexpr, OUT: tl.constexpr):
    """Four dequantized float16 field tiles ``o + code * s`` of uint8 ``codes`` ``[n, D/4]``; ``sc``/``of``:
    float16, broadcast to the codes' shape (a row's or a column's scale and offset). Returned as ``OUT``."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _DEQUANT_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [codes, sc, of],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
        f0, f1, f2, f3 = f0.to(OUT), f1.to(OUT), f2.to(OUT), f3.to(OUT)
    else:  # float32 products, rounded to float16 like the fma (a double rounding only on exact ties)
        c0, c1, c2, c3 = _unpack4(codes, 0, False, tl.float32)
        s32 = sc.to(tl.float32)
        o32 = of.to(tl.float32)
        f0 = (c0 * s32 + o32).to(tl.float16).to(OUT)
        f1 = (c1 * s32 + o32).to(tl.float16).to(OUT)
        f2 = (c2 * s32 + o32).to(tl.float16).to(OUT)
        f3 = (c3 * s32 + o32).to(tl.float16).to(OUT)
    return f0, f1, f2, f3


@triton.jit
def _cat4(f0, f1, f2, f3, R: tl.constexpr, D: tl.constexpr):
    """Four ``[R, D/4]`` blocks -> ``[R, D]`` with column block ``j`` = ``f_j`` (natural element order)."""
    x = tl.join(tl.join(f0, f1), tl.join(f2, f3))  # [n, c, a, b] = f_{2b+a}[n, c]
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (R, D))


@triton.jit
def _online(s, m_i, csc, lv, tau, LAZY: tl.constexpr):
    """Online softmax over logits ``s`` (``csc`` converts them to log2 units). Returns the new reference max
    (raised only past ``m_i + tau`` when ``LAZY``: weights may then reach ``2^(csc tau)``), the factor ``alpha``
    for the old sums and the weights ``p = 2^(csc (s - m) - lv)`` (``2^lv`` = v_ref, folded in here)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if LAZY:
        m_new = tl.where(m_new > m_i + tau, m_new, m_i)
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows fully masked so far stay at zero weight
    alpha = tl.exp2((m_i - m_use) * csc)
    p = tl.exp2(s * csc - (m_use * csc + lv)[:, None])
    return m_new, alpha, p


@triton.jit
def _scale_acc(a0, a1, a2, a3, alpha, VCAT: tl.constexpr):
    a0 = a0 * alpha[:, None]
    if not VCAT:
        a1 = a1 * alpha[:, None]
        a2 = a2 * alpha[:, None]
        a3 = a3 * alpha[:, None]
    return a0, a1, a2, a3


@triton.jit
def _rescale(a0, a1, a2, a3, alpha, moved, LAZY: tl.constexpr, VCAT: tl.constexpr):
    """The accumulators times ``alpha`` before a page's ``P V``: every page (flash attention), or with ``LAZY``
    only when some row's reference max ``moved`` (one block-wide flag; it rarely moves after the first pages)."""
    if LAZY:
        if tl.max(moved.to(tl.int32), axis=0) > 0:
            a0, a1, a2, a3 = _scale_acc(a0, a1, a2, a3, alpha, VCAT)
    else:
        a0, a1, a2, a3 = _scale_acc(a0, a1, a2, a3, alpha, VCAT)
    return a0, a1, a2, a3


@triton.jit
def _channel_logits(k0, k1, k2, k3, page, h, ks_ptr, ko_ptr, s_kmp, s_kmh, qk0, qk1, qk2, qk3, D: tl.constexpr,
                    PS: tl.constexpr, DT: tl.constexpr, KCAT: tl.constexpr):
    """Logits of the prescaled float16 query over one channel page (code tiles ``k_j``)."""
    DQ: tl.constexpr = D // 4
    c = tl.arange(0, DQ)
    # channel page (written whole, metadata valid): dequantize the tile, normalised by its largest |k^| so
    # that the 16-bit operand cannot overflow, and undo the normalisation on the logits
    kmeta = page * s_kmp + h * s_kmh
    if KCAT:
        dcol = tl.arange(0, D)
        ksv = tl.load(ks_ptr + kmeta + dcol).to(tl.float32)
        kov = tl.load(ko_ptr + kmeta + dcol).to(tl.float32)
        khat = kov[None, :] + _cat4(k0, k1, k2, k3, PS, D).to(tl.float32) * ksv[None, :]
        kmax = tl.max(tl.maximum(tl.abs(kov), tl.abs(kov + 3.0 * ksv)), axis=0)
        kmax = tl.where(kmax > 0.0, kmax, 1.0)
        s = tl.dot(qk0, tl.trans((khat * (1.0 / kmax)).to(tl.float16).to(DT))) * kmax
    else:
        ks0 = tl.load(ks_ptr + kmeta + c).to(tl.float32)
        ks1 = tl.load(ks_ptr + kmeta + DQ + c).to(tl.float32)
        ks2 = tl.load(ks_ptr + kmeta + 2 * DQ + c).to(tl.float32)
        ks3 = tl.load(ks_ptr + kmeta + 3 * DQ + c).to(tl.float32)
        ko0 = tl.load(ko_ptr + kmeta + c).to(tl.float32)
        ko1 = tl.load(ko_ptr + kmeta + DQ + c).to(tl.float32)
        ko2 = tl.load(ko_ptr + kmeta + 2 * DQ + c).to(tl.float32)
        ko3 = tl.load(ko_ptr + kmeta + 3 * DQ + c).to(tl.float32)
        kmax = tl.maximum(tl.maximum(tl.max(tl.maximum(tl.abs(ko0), tl.abs(ko0 + 3.0 * ks0)), axis=0),
                                     tl.max(tl.maximum(tl.abs(ko1), tl.abs(ko1 + 3.0 * ks1)), axis=0)),
                          tl.maximum(tl.max(tl.maximum(tl.abs(ko2), tl.abs(ko2 + 3.0 * ks2)), axis=0),
                                     tl.max(tl.maximum(tl.abs(ko3), tl.abs(ko3 + 3.0 * ks3)), axis=0)))
        kmax = tl.where(kmax > 0.0, kmax, 1.0)
        ik = 1.0 / kmax
        h0 = ((ko0[None, :] + k0.to(tl.float32) * ks0[None, :]) * ik).to(tl.float16).to(DT)
        h1 = ((ko1[None, :] + k1.to(tl.float32) * ks1[None, :]) * ik).to(tl.float16).to(DT)
        h2 = ((ko2[None, :] + k2.to(tl.float32) * ks2[None, :]) * ik).to(tl.float16).to(DT)
        h3 = ((ko3[None, :] + k3.to(tl.float32) * ks3[None, :]) * ik).to(tl.float16).to(DT)
        s = tl.dot(qk0, tl.trans(h0))
        s = tl.dot(qk1, tl.trans(h1), s)
        s = tl.dot(qk2, tl.trans(h2), s)
        s = tl.dot(qk3, tl.trans(h3), s)
        s = s * kmax
    return s


@triton.jit
def _fa_update(s, v, m_i, l_i, acc, csc, P16: tl.constexpr):
    """Flash-attention step of the dense kernel: online softmax over logits ``s`` (unscaled; ``csc`` =
    ``sm_scale log2(e)``, folded into the exponent's one fma), the accumulator rescaled and ``P V`` added, with
    ``P`` rounded to ``P16`` (the value tile's 16-bit dtype) and entering the dot in ``v``'s dtype."""
    m_new, alpha, p = _online(s, m_i, csc, 0.0, 0.0, False)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(P16).to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc

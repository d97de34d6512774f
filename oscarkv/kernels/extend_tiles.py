"""Triton device functions of the extend kernel (:mod:`oscarkv.kernels.extend_triton`) and of the page
dequantization (:mod:`oscarkv.kernels.dequant_triton`): a page tile of any format dequantized to float16
``o + c s`` in natural element order (2-bit token pages by inline PTX on CUDA: one fma per code pair, which also
removes the magic-number bias; integer ops elsewhere), the program geometry, and the online-softmax step.
Field ``j`` of packed byte ``c`` is element ``j d / (8 / bits) + c`` of the row, so field tiles side by side are
the row in natural order."""

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
def _dequant4(codes, sc, of, ASM: tl.constexpr):
    """Four dequantized float16 field tiles ``o + code * s`` of 2-bit ``codes`` ``[n, D/4]``; ``sc``/``of``:
    float16, broadcast to the codes' shape."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _DEQUANT_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [codes, sc, of],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:  # float32 products, rounded to float16 like the fma (a double rounding only on exact ties)
        x = codes.to(tl.int32)
        s32 = sc.to(tl.float32)
        o32 = of.to(tl.float32)
        f0 = ((x & 3).to(tl.float32) * s32 + o32).to(tl.float16)
        f1 = (((x >> 2) & 3).to(tl.float32) * s32 + o32).to(tl.float16)
        f2 = (((x >> 4) & 3).to(tl.float32) * s32 + o32).to(tl.float16)
        f3 = (((x >> 6) & 3).to(tl.float32) * s32 + o32).to(tl.float16)
    return f0, f1, f2, f3


@triton.jit
def _cat4(f0, f1, f2, f3, R: tl.constexpr, D: tl.constexpr):
    """Four ``[R, D/4]`` blocks -> ``[R, D]`` with column block ``j`` = ``f_j`` (natural element order)."""
    x = tl.join(tl.join(f0, f1), tl.join(f2, f3))  # [n, c, a, b] = f_{2b+a}[n, c]
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (R, D))


@triton.jit
def _cat2(f0, f1, R: tl.constexpr, D: tl.constexpr):
    """Two ``[R, D/2]`` blocks -> ``[R, D]`` with column block ``j`` = ``f_j``."""
    return tl.reshape(tl.permute(tl.join(f0, f1), (0, 2, 1)), (R, D))


@triton.jit
def _codes_natural(codes, BITS: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """Codes of ``R`` packed rows ``[R, D BITS / 8]`` (uint8) as float32 ``[R, D]`` in natural element order."""
    x = codes.to(tl.int32)
    if BITS == 2:
        c = _cat4(x & 3, (x >> 2) & 3, (x >> 4) & 3, (x >> 6) & 3, R, D)
    else:
        c = _cat2(x & 15, x >> 4, R, D)
    return c.to(tl.float32)


@triton.jit
def _dequant_tile(codes_ptr, sc_ptr, of_ptr, page, h, s_cp, s_ch, s_mp, s_mh, rows, live,
                  BITS: tl.constexpr, CH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, ASM: tl.constexpr):
    """Dequantized float16 rows ``[R, D]`` (natural order) of a page tile: in-page rows ``rows`` ``[R]`` of
    physical pages ``page`` (a scalar, or ``[R]`` for a tile of several pages; channel pages: a scalar). Token
    pages: a scale/offset per row, rows not ``live`` (past a sequence's end: stale, maybe NaN metadata) are
    zeros; channel pages (written whole): a scale/offset per channel of the page, rows not ``live`` zeros too."""
    RB: tl.constexpr = D * BITS // 8
    crow = page * s_cp + h * s_ch + rows * RB
    codes = tl.load(codes_ptr + crow[:, None] + tl.arange(0, RB)[None, :])
    if CH:
        dcol = tl.arange(0, D)
        ks = tl.load(sc_ptr + page * s_mp + h * s_mh + dcol).to(tl.float32)
        ko = tl.load(of_ptr + page * s_mp + h * s_mh + dcol).to(tl.float32)
        x = ko[None, :] + _codes_natural(codes, BITS, R, D) * ks[None, :]
        r = tl.where(live[:, None], x, 0.0).to(tl.float16)
    else:
        mrow = page * s_mp + h * s_mh + rows
        sc = tl.where(live, tl.load(sc_ptr + mrow), 0.0).to(tl.float16)
        of = tl.where(live, tl.load(of_ptr + mrow), 0.0).to(tl.float16)
        if BITS == 2:
            f0, f1, f2, f3 = _dequant4(codes, tl.broadcast_to(sc[:, None], (R, D // 4)),
                                       tl.broadcast_to(of[:, None], (R, D // 4)), ASM)
            r = _cat4(f0, f1, f2, f3, R, D)
        else:
            x = of.to(tl.float32)[:, None] + _codes_natural(codes, BITS, R, D) * sc.to(tl.float32)[:, None]
            r = x.to(tl.float16)
    return r


@triton.jit
def _online(s, m_i, csc):
    """Online softmax over logits ``s`` (``csc`` converts them to log2 units): the new running max, the factor
    ``alpha`` for the old sums and the weights ``p = 2^(csc (s - m))``; rows fully masked so far keep weight 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2((m_i - m_use) * csc)
    p = tl.exp2(s * csc - (m_use * csc)[:, None])
    return m_new, alpha, p

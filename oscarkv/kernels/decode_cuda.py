"""CUDA C++ decode kernel (``csrc/decode.cu``): built with nvcc into a cubin (cached on disk), loaded and launched
through the CUDA driver API with ctypes on torch's current stream (so CUDA graphs capture it).

Every per-layer storage format: keys in token or channel pages of 2 or 4 bits, values in token pages of 2 or 4
bits, in any combination. No PyTorch extension build is needed: the kernel takes one plain-old-data parameter
block. Semantics, plan and workspace are those of :func:`oscarkv.kernels.decode_triton.decode_attention_triton`
(the portable twin that the CPU interpreter tests).

How a launch is compiled (all decided here from the call; nothing is configured from outside): the quantized
tier's loop streams each warp's pages through two cp.async stages in shared memory, except for the 2-bit formats
(keys in token or channel pages) at a few (sequence, KV head) pairs, where a one-chunk register prefetch is
faster; at a few pairs either loop also asks for pages ahead into L2; both tiers run in one launch up to
:data:`FUSED_UNITS` pairs, one launch per tier above; ``pdl`` adds the programmatic-dependent-launch waits and
signals.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from ._triton_util import check_decode
from .layout import PageFormat, QuantPages
from .plan import DecodePlan

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("decode.cu", "decode_quant.cuh", "decode_common.cuh")
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_NW = 4  # warps per CTA
FEW_UNITS = 8  # at most this many (sequence, KV head) pairs: the register-prefetch loop for 2-bit formats
FUSED_UNITS = 64  # at most this many pairs: both tiers in one launch
_SMEM_LIMIT = 227 * 1024  # shared memory of one CTA on sm_90


def _cache_dir() -> Path:
    """Where built cubins are kept: ``$OSCARKV_CUBIN_CACHE`` or ``~/.cache/oscarkv/cubin`` (a location only)."""
    return Path(os.environ.get("OSCARKV_CUBIN_CACHE", Path.home() / ".cache" / "oscarkv" / "cubin"))


@functools.lru_cache(maxsize=1)
def nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def _register_loop(k_fmt: PageFormat, v_fmt: PageFormat, units: int) -> bool:
    """The register-prefetch loop (with L2 prefetch) serves 2-bit formats at a few pairs: the register budget
    holds their chunk buffers (4-bit ones spill there), and one sequence's few warps gain more from the L2
    prefetch than from the cp.async stages, which make a warp of two or three pages wait for a whole page
    before its first chunk. Channel-page keys read their page's scale and offset rows from global memory there.
    It also serves 2-bit formats at any count of pairs where the stages would not fit a CTA's shared memory."""
    two_bit = k_fmt.bits == 2 and v_fmt.bits == 2
    return two_bit and (units <= FEW_UNITS or sum(_smem(k_fmt, v_fmt, True)) > _SMEM_LIMIT)


def _stage_bytes(d: int, ps: int, kb: int, vb: int, kch: bool, msz: int) -> int:
    """Shared memory per warp of the cp.async loop (``CP_WREG`` in csrc/decode_quant.cuh): two page stages of
    K codes, V codes and metadata rows, each stage rounded up to 128 bytes, at least the warp's partial outputs."""
    kmrow = d if kch else ps
    stage = ps * d * kb // 8 + ps * d * vb // 8 + 2 * ps * msz + 2 * kmrow * msz
    stage = -(-stage // 128) * 128
    return -(-max(2 * stage, 8 * d * 4) // 128) * 128


def _smem(k_fmt: PageFormat, v_fmt: PageFormat, cpa: bool) -> tuple[int, int]:
    """(dynamic, static) shared memory of a CTA: the stages of the cp.async loop; the warps' softmax state, the
    partial outputs of the register loop and the query rows of channel-page keys."""
    d, msz = k_fmt.head_dim, torch.empty((), dtype=k_fmt.meta_dtype).element_size()
    static = 2 * _NW * 8 * 4 + (8 * (d + 4) * 4 if k_fmt.channel else 0)
    if not cpa:
        return 0, static + _NW * 8 * d * 4
    return _NW * _stage_bytes(d, k_fmt.page_size, k_fmt.bits, v_fmt.bits, k_fmt.channel, msz), static


def unsupported(k_fmt: PageFormat, v_fmt: PageFormat, num_q_heads: int | None = None,
                dtype16: torch.dtype | None = None, q_dtype: torch.dtype | None = None) -> str | None:
    """Why the CUDA kernel cannot serve these pools (a sentence), or None. Formats: K and V of one geometry
    (heads, head_dim, page size, metadata dtype), one scale/offset group per row, head_dim 64/128/256, page size a
    multiple of 16 (at most 256 with channel-page keys), the cp.async stages within a CTA's shared memory; at most
    8 query heads per KV head; 16-bit tiers of float16/bfloat16 and queries of float32/float16/bfloat16 (a dtype
    or head count left None is not checked); nvcc or a prebuilt cubin cache."""
    d, ps = k_fmt.head_dim, k_fmt.page_size
    if v_fmt.channel:
        return "values are stored in token pages only"
    if (k_fmt.num_kv_heads, d, ps, k_fmt.meta_dtype) != (v_fmt.num_kv_heads, v_fmt.head_dim, v_fmt.page_size,
                                                          v_fmt.meta_dtype):
        return "K and V pools must share heads, head_dim, page size and metadata dtype"
    if k_fmt.groups != 1 or v_fmt.groups != 1:
        return "the kernel takes one scale/offset group per row (group_size None)"
    if d not in (64, 128, 256):
        return f"head_dim must be 64, 128 or 256, got {d}"
    if ps % 16 or (k_fmt.channel and ps > 256):
        return f"page_size must be a multiple of 16 (at most 256 with channel-page keys), got {ps}"
    if not _register_loop(k_fmt, v_fmt, 1) and sum(_smem(k_fmt, v_fmt, True)) > _SMEM_LIMIT:
        return f"page_size {ps} needs more shared memory per CTA than sm_90 has at head_dim {d}"
    if num_q_heads is not None and (num_q_heads % k_fmt.num_kv_heads or num_q_heads // k_fmt.num_kv_heads > 8):
        return f"at most 8 query heads per KV head, got {num_q_heads} for {k_fmt.num_kv_heads} KV heads"
    if dtype16 is not None and dtype16 not in (torch.float16, torch.bfloat16):
        return f"16-bit tiers must be float16 or bfloat16, got {dtype16}"
    if q_dtype is not None and q_dtype not in _DT:
        return f"queries must be float32, float16 or bfloat16, got {q_dtype}"
    if nvcc() is None and not any(_cache_dir().glob("*.cubin")):
        return "no nvcc (CUDA toolkit) and no prebuilt cubin cache"
    return None


def supported(k_fmt: PageFormat, v_fmt: PageFormat, num_q_heads: int | None = None,
              dtype16: torch.dtype | None = None, q_dtype: torch.dtype | None = None) -> bool:
    """Whether the CUDA kernel serves these pools (:func:`unsupported` gives the reason when not)."""
    return unsupported(k_fmt, v_fmt, num_q_heads, dtype16, q_dtype) is None


def config_key(k_fmt: PageFormat, v_fmt: PageFormat, g: int, q_dtype: torch.dtype, dtype16: torch.dtype,
               units: int, part: int, *, pdl: bool = False, cpa: bool = True, l2pf: bool = True,
               arch: int = 90) -> tuple:
    """The compile-time defines of one launch (csrc/decode_common.cuh): formats, dtypes, ``part`` (0 both tiers,
    1 quantized only, 2 16-bit only) and the loop for ``units`` (sequence, KV head) pairs. ``cpa``: the pools
    take the cp.async stages (16-byte aligned pages; page strides below 4 GiB); ``l2pf``: page strides below
    4 GiB (the L2 prefetch's addressing, which launches of at most :data:`FEW_UNITS` pairs add to either loop)."""
    d = k_fmt.head_dim
    reg = _register_loop(k_fmt, v_fmt, units) or not cpa
    l2 = l2pf and units <= FEW_UNITS  # more bytes in flight where few warps run
    meta = k_fmt.meta_dtype
    return (("D_", d), ("GQ_", g), ("PS_", k_fmt.page_size), ("NW_", _NW), ("QT_", _DT[q_dtype]),
            ("T16_", _DT[dtype16]), ("MT_", _DT[meta] if meta != torch.float32 else 0),
            ("MINB_", 4 if d <= 128 else 2), ("PART_", part), ("KB_", k_fmt.bits), ("VB_", v_fmt.bits),
            ("KCH_", int(k_fmt.channel)), ("CPA_", int(not reg)), ("L2PF_", int(l2)), ("PDL_", int(pdl)),
            ("PDLW_", int(pdl)), ("EARLY_", int(pdl and l2)), ("ARCH", arch))


def _key_smem(key: tuple) -> int:
    """Dynamic shared memory of the split kernel of ``key`` (the cp.async stages; 0 for the register loop)."""
    k = dict(key)
    if not k["CPA_"]:
        return 0
    return _NW * _stage_bytes(k["D_"], k["PS_"], k["KB_"], k["VB_"], bool(k["KCH_"]), 4 if k["MT_"] == 0 else 2)


def build(key: tuple) -> Path:
    """Compile one configuration to a cubin (or reuse the cached one); returns its path."""
    src = b"".join((_CSRC / name).read_bytes() for name in _SOURCES)
    digest = hashlib.sha256(src + repr(key).encode()).hexdigest()[:20]
    out = _cache_dir() / f"decode_{digest}.cubin"
    if out.exists():
        return out
    exe = nvcc()
    if exe is None:
        raise RuntimeError("the CUDA decode kernel needs nvcc (CUDA toolkit) or a prebuilt cubin cache")
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = dict(key)["ARCH"]
    defs = [f"-D{k}={v}" for k, v in key if k != "ARCH"]
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [exe, f"-arch=sm_{arch}", "-O3", "-std=c++17", "-cubin", *defs, "-o", str(tmp), str(_CSRC / _SOURCES[0])]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
    tmp.replace(out)
    return out


class _Driver:
    """The few CUDA driver entry points needed, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        if hasattr(self.lib, "cuLaunchKernelEx"):  # CUDA 12+ drivers; only launches with pdl=True use it
            self.lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                                  ctypes.c_void_p]

    def check(self, res: int, what: str) -> None:
        if res != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(res, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: CUDA error {res} ({(msg.value or b'?').decode()})")


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver:
    return _Driver()


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.lru_cache(maxsize=128)
def _functions(key: tuple, device_index: int) -> tuple[int, int]:
    torch.cuda.init()
    with torch.cuda.device(device_index):
        torch.empty(1, device="cuda")  # make the primary context current on this thread
        drv = _driver()
        image = build(key).read_bytes()
        mod = ctypes.c_void_p()
        drv.check(drv.lib.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        fns = []
        for name in (b"oscar_decode_split", b"oscar_decode_merge"):
            fn = ctypes.c_void_p()
            drv.check(drv.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name), "cuModuleGetFunction")
            fns.append(fn.value)
        smem = _key_smem(key)
        if smem:  # the cp.async stages: opt in to more than 48 KB of dynamic shared memory, prefer it over L1
            drv.check(drv.lib.cuFuncSetAttribute(fns[0], _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                      "cuFuncSetAttribute(max dynamic shared memory)")
            drv.check(drv.lib.cuFuncSetAttribute(fns[0], _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
                      "cuFuncSetAttribute(shared memory carveout)")
        return fns[0], fns[1]


def _struct(name: str, fields: list[tuple[str, object]]):
    return type(name, (ctypes.Structure,), {"_fields_": fields})


_P_PTRS = ["q", "kc", "vc", "ks", "ko", "vs", "vo", "bt", "qlen", "k16", "v16", "len16", "o_part", "lse_part"]
_P_INTS = ["sq_b", "sq_h", "s_kcp", "s_kch", "s_vcp", "s_vch", "s_kmp", "s_kmh", "s_vmp", "s_vmh", "s_bt", "s16_b",
           "s16_h", "s16_t", "so_b", "so_h", "so_s", "sl_b", "sl_h", "hkv", "tok_per_split", "num_qsplits",
           "tok16_per_split"]
_P_FIELDS = ([(n, ctypes.c_uint64) for n in _P_PTRS] + [(n, ctypes.c_int64) for n in _P_INTS]
             + [("sm_scale_log2", ctypes.c_double)]
             + [(n, ctypes.c_int64) for n in ("gran_pages", "least_pages")])
_Params = _struct("_Params", _P_FIELDS)
_MergeParams = _struct("_MergeParams", [(n, ctypes.c_uint64) for n in ("o_part", "lse_part", "out")] + [
    (n, ctypes.c_int64) for n in ["so_b", "so_h", "so_s", "sl_b", "sl_h", "sout_b", "sout_h", "hq", "num_splits",
                                  "out_dtype"]])


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "smem")] + [
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


def _launch(fn: int, grid: tuple[int, int], block: int, params: ctypes.Structure, stream: int, smem: int = 0,
            pdl: bool = False) -> None:
    """``pdl``: launch as a programmatic dependent of the previous kernel in the stream (its griddepcontrol.wait
    returns once that grid has completed and its memory is visible)."""
    drv = _driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    if not pdl:
        res = drv.lib.cuLaunchKernel(fn, grid[0], grid[1], 1, block, 1, 1, smem, stream, args, None)
        drv.check(res, "cuLaunchKernel")
        return
    attr = _LaunchAttr(_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    cfg = _LaunchConfig(grid[0], grid[1], 1, block, 1, 1, smem, stream, ctypes.pointer(attr), 1)
    drv.check(drv.lib.cuLaunchKernelEx(ctypes.byref(cfg), fn, args, None), "cuLaunchKernelEx(programmatic)")


def _small_strides(k_pages: QuantPages, v_pages: QuantPages) -> bool:
    """Page strides below 4 GiB: the loops address a page as one 32-bit product."""
    return all(t.stride(0) * t.element_size() < 2**32 for p in (k_pages, v_pages) for t in (p.codes, p.scale))


def _cpa_aligned(k_pages: QuantPages, v_pages: QuantPages) -> bool:
    """The cp.async stages copy whole (page, head) blocks of codes and metadata rows in 16-byte pieces."""
    for pages in (k_pages, v_pages):
        es = pages.scale.element_size()
        if pages.codes.data_ptr() % 16 or pages.codes.stride(0) % 16 or pages.codes.stride(1) % 16:
            return False
        for t in (pages.scale, pages.offset):
            if t.data_ptr() % 16 or (t.stride(0) * es) % 16 or (t.stride(1) * es) % 16:
                return False
    return True


def _validate(q, k_pages, v_pages, k16, v16, cpa: bool) -> None:
    why = unsupported(k_pages.fmt, v_pages.fmt, q.shape[1], k16.dtype, q.dtype)
    if why:
        raise ValueError(f"the CUDA decode kernel cannot serve this call: {why}; use backend='triton'")
    if k_pages.fmt.channel and not cpa:
        raise ValueError("the CUDA decode kernel reads channel-page key metadata in 16-byte pieces: the pools "
                         "need 16-byte aligned pages and page strides below 4 GiB; use backend='triton'")
    if any(s % 8 for s in k16.stride()[:3]) or k16.data_ptr() % 16 or v16.data_ptr() % 16:
        raise ValueError("k16/v16 rows must be 16-byte aligned (strides multiple of 8 elements)")
    for pages in (k_pages, v_pages):
        if pages.fmt.row_bytes * pages.fmt.page_size % 16 or pages.codes.stride(1) % 16 or \
                pages.codes.stride(0) % 16:
            raise ValueError("code pages must be 16-byte aligned")
        pair = 2 * pages.scale.element_size()  # metadata of two adjacent rows is read as one load
        for t in (pages.scale, pages.offset):
            if t.data_ptr() % pair or t.stride(0) % 2 or t.stride(1) % 2:
                raise ValueError(f"scale/offset pages must be {pair}-byte aligned with even page and head strides")


def prebuild(fmt: PageFormat, num_q_heads: int, q_dtype: torch.dtype, dtype16: torch.dtype, max_batch: int, *,
             v_fmt: PageFormat | None = None, pdl: bool = False, workers: int | None = None) -> list[Path]:
    """Build (or find in the cache) every cubin that launches of 1..``max_batch`` sequences over key pools of
    ``fmt`` and value pools of ``v_fmt`` (default: token pages of ``fmt``'s bits) can load: the loop for a few
    pairs and for more, one launch or one per tier. A launch builds its cubin on first use (about 1.7 s of nvcc
    each on an H200 machine), so a server calls this at start instead of stalling its first requests. Returns the
    cubins' paths; none where the CUDA kernel does not serve these shapes."""
    v_fmt = v_fmt or PageFormat(fmt.num_kv_heads, fmt.head_dim, fmt.page_size, fmt.bits, fmt.group_size,
                                fmt.meta_dtype)
    if not supported(fmt, v_fmt, num_q_heads, dtype16, q_dtype):
        return []
    g = num_q_heads // fmt.num_kv_heads
    keys: dict[tuple, None] = {}
    for b in range(1, max_batch + 1):
        units = b * fmt.num_kv_heads
        for part in ((0,) if units <= FUSED_UNITS else (1, 2)):
            keys[config_key(fmt, v_fmt, g, q_dtype, dtype16, units, part, pdl=pdl)] = None
        if units > max(FEW_UNITS, FUSED_UNITS):  # larger batches pick the same configurations
            break
    if not keys:
        return []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers or min(len(keys), os.cpu_count() or 4)) as pool:
        return list(pool.map(build, keys))  # nvcc runs in subprocesses: threads suffice


def decode_attention_cuda(
    q: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor,
    k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    plan: DecodePlan | None = None, out: Tensor | None = None, pdl: bool = False,
) -> Tensor:
    """Decode attention with the CUDA C++ kernel; arguments, result and plan as
    :func:`oscarkv.kernels.decode_triton.decode_attention_triton`. Raises ``ValueError`` where
    :func:`unsupported` names a reason. No host synchronisation: graph-safe with a preallocated plan.

    ``pdl``: launch the split kernel as a programmatic dependent of the previous kernel on the stream (it waits
    for that kernel at its start, so its launch and prologue overlap that kernel's tail), the merge kernel as a
    dependent of the split kernel, and let the next kernel start during the merge (that kernel must itself wait,
    griddepcontrol.wait / Triton's gdc_wait, before reading the output)."""
    B, hq, d = q.shape
    fmt = k_pages.fmt
    if plan is None:
        plan = DecodePlan(B, hq, fmt.num_kv_heads, d, fmt.page_size, block_table.shape[1], k16.shape[2],
                          device=q.device)
    check_decode(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan)
    small = _small_strides(k_pages, v_pages)
    cpa = small and _cpa_aligned(k_pages, v_pages)
    _validate(q, k_pages, v_pages, k16, v16, cpa)
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    if out.dtype not in _DT or out.shape != (B, hq, d) or out.stride(2) != 1:
        raise ValueError(f"out must be [{B}, {hq}, {d}] float32/float16/bfloat16 with unit last stride")
    g = hq // fmt.num_kv_heads
    units = B * fmt.num_kv_heads
    o, lse = plan.o_part, plan.lse_part
    scale = float(d**-0.5 if sm_scale is None else sm_scale) * 1.4426950408889634
    kc, vc = k_pages.codes, v_pages.codes
    p = _Params(
        q.data_ptr(), kc.data_ptr(), vc.data_ptr(), k_pages.scale.data_ptr(), k_pages.offset.data_ptr(),
        v_pages.scale.data_ptr(), v_pages.offset.data_ptr(), block_table.data_ptr(), qlen.data_ptr(),
        k16.data_ptr(), v16.data_ptr(), len16.data_ptr(), o.data_ptr(), lse.data_ptr(),
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), k_pages.scale.stride(0),
        k_pages.scale.stride(1), v_pages.scale.stride(0), v_pages.scale.stride(1), block_table.stride(0),
        k16.stride(0), k16.stride(1), k16.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
        lse.stride(1), fmt.num_kv_heads, plan.pages_per_split * fmt.page_size, plan.num_qsplits,
        plan.tokens16_per_split, scale, *plan.split_granule,
    )
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    parts = [(0, plan.num_splits)] if units <= FUSED_UNITS else [(1, plan.num_qsplits), (2, plan.num_splits16)]
    key = None
    for part, nsplit in parts:
        key = config_key(k_pages.fmt, v_pages.fmt, g, q.dtype, k16.dtype, units, part, pdl=pdl, cpa=cpa, l2pf=small)
        if nsplit == 0:
            continue
        split_fn, _ = _functions(key, dev)
        _launch(split_fn, (nsplit, units), 32 * _NW, p, stream, smem=_key_smem(key), pdl=pdl)
    _, merge_fn = _functions(key, dev)
    mp = _MergeParams(o.data_ptr(), lse.data_ptr(), out.data_ptr(), o.stride(0), o.stride(1), o.stride(2),
                      lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), hq, plan.num_splits, _DT[out.dtype])
    # one CTA per (sequence, query head, 32 outputs), 256 threads: MERGE_SLICE / MERGE_THREADS in the .cu
    _launch(merge_fn, (B * hq * (d // 32), 1), 256, mp, stream, pdl=pdl)
    return out


__all__ = [
    "FEW_UNITS",
    "FUSED_UNITS",
    "build",
    "config_key",
    "decode_attention_cuda",
    "nvcc",
    "prebuild",
    "supported",
    "unsupported",
]

"""CUDA C++ decode kernel (``csrc/decode_int2.cu``): build with nvcc into a cubin (cached on disk), load and
launch it through the CUDA driver API with ctypes on torch's current stream (so CUDA graphs capture it).

No PyTorch extension build is needed: the kernel takes one plain-old-data parameter block. Semantics, plan and
workspace are those of :func:`oscarkv.kernels.decode_triton.decode_attention_triton`; the Triton kernel stays
the portable path (and the one the CPU interpreter tests).
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

from .layout import PageFormat, QuantPages
from .plan import DecodePlan

_SRC = Path(__file__).parent / "csrc" / "decode_int2.cu"
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_NW = 4


def _cache_dir() -> Path:
    """Where built cubins are kept: ``$OSCARKV_CUBIN_CACHE`` or ``~/.cache/oscarkv/cubin`` (a location only)."""
    return Path(os.environ.get("OSCARKV_CUBIN_CACHE", Path.home() / ".cache" / "oscarkv" / "cubin"))


@functools.lru_cache(maxsize=1)
def nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def supported(fmt: PageFormat, dtype16: torch.dtype | None = None, q_dtype: torch.dtype | None = None) -> bool:
    """Whether the CUDA kernel can run: formats (2-bit token pages, one group per row, d 64/128/256, page a
    multiple of 16; keys in channel pages go to the Triton kernel), 16-bit tiers of ``dtype16`` float16 or
    bfloat16 only (float32 windows go to the Triton kernel) and queries of ``q_dtype`` float32/float16/bfloat16
    (a dtype left None is not checked); nvcc or a prebuilt cubin cache."""
    return (fmt.layout == "token" and fmt.bits == 2 and fmt.groups == 1 and fmt.head_dim in (64, 128, 256)
            and fmt.page_size % 16 == 0
            and (dtype16 is None or dtype16 in (torch.float16, torch.bfloat16))
            and (q_dtype is None or q_dtype in _DT)
            and (nvcc() is not None or any(_cache_dir().glob("*.cubin"))))


# Compile-time variants of the 2-bit loop (csrc/decode_int2.cu header): "subn" (codes as float16 subnormals, no
# 1024 bias to remove), "lazy" (the softmax maximum raised only when exceeded by 2^3), "l2pf" (each warp
# prefetches its next page into L2 with prefetch.global.L2; page strides below 4 GiB). On the H200 the three
# took 128K x 64 from 2.08 to 1.71 ms (2.36 -> 2.87 TB/s), 128K x 8 from 0.308 to 0.249 ms and 128K x 1 from
# 0.057 to 0.049 ms, every GPU test passing (docs/results/kernels_h200.md, session 13).
# Second round: "cpa" / "cpa3" (each warp streams its pages global -> shared
# memory with cp.async, 2 / 3 page stages, instead of the one-chunk register prefetch; page strides below 4 GiB,
# code and metadata pages 16-byte aligned; dynamic shared memory, see `_smem_bytes`), "qk2" (two independent mma
# chains for a chunk's QK product), "pdl" (the merge kernel is a programmatic dependent launch of the split
# kernel), "pdlw" (the split kernel waits for the kernel before it as a programmatic dependent: set by
# ``pdl=True``, which also sets "pdl"), "early" (with "l2pf": each warp's first two pages prefetched into L2 at
# the kernel's start, before the Q setup and the "pdlw" wait). A value is a define, set to 1 when the name is
# picked, or (define, value).
VARIANTS = {"subn": "SUBN_", "lazy": "LAZY_", "l2pf": "L2PF_", "cpa": ("CPA_", 2), "cpa3": ("CPA_", 3),
            "qk2": "QK2_", "pdl": "PDL_", "pdlw": "PDLW_", "early": "EARLY_"}
# Defaults from the H200 sweeps (docs/results/kernels_h200.md, session 13): the cp.async pipeline wins from 2
# sequences of 8 KV heads up (128K x 64: 1.446 vs 1.712 ms, 3.39 TB/s; 128K x 8: 0.224 vs 0.250), the register
# prefetch + L2 prefetch for a single sequence's few (sequence, KV head) units (128K x 1: 0.0494 vs 0.0516 ms).
DEFAULT_VARIANT = "subn+lazy+cpa"
DEFAULT_VARIANT_FEW = "subn+lazy+l2pf"  # at most FEW_UNITS (sequence, KV head) pairs
FEW_UNITS = 8
FUSED_UNITS = 64  # at most this many (sequence, KV head) pairs: both tiers in one launch by default
VARIANT_ENV = "OSCARKV_CUDA_DECODE_VARIANT"  # overrides the defaults of ``variant=None``; "none" = no variant


def _resolve_variant(variant: str | None, units: int | None = None) -> str:
    if variant is None:
        default = DEFAULT_VARIANT_FEW if units is not None and units <= FEW_UNITS else DEFAULT_VARIANT
        variant = os.environ.get(VARIANT_ENV, default)
    return "" if variant == "none" else variant


def _variant_names(variant: str | None) -> list[str]:
    return [v for v in _resolve_variant(variant).replace(",", "+").split("+") if v]


def _variant_flags(variant: str | None) -> dict[str, int]:
    names = _variant_names(variant)
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown CUDA decode variant(s) {bad}: choose from {sorted(VARIANTS)}, joined by '+'")
    flags: dict[str, int] = {}
    for name, spec in VARIANTS.items():
        define, value = (spec, 1) if isinstance(spec, str) else spec
        flags.setdefault(define, 0)
        if name in names:
            if flags[define] not in (0, value):
                raise ValueError(f"CUDA decode variants {sorted(n for n in names if n in VARIANTS)} set {define} twice")
            flags[define] = value
    if flags["EARLY_"] and not flags["L2PF_"]:
        raise ValueError("CUDA decode variant 'early' needs 'l2pf' (its per-lane page prefetch)")
    return flags


def config_key(d: int, g: int, page: int, q_dtype, dtype16, meta_dtype, part: int, arch: int = 90,
               variant: str | None = None) -> tuple:
    minb = 4 if d <= 128 else 2
    flags = _variant_flags(variant)
    return (("D_", d), ("GQ_", g), ("PS_", page), ("NW_", _NW), ("QT_", _DT[q_dtype]), ("T16_", _DT[dtype16]),
            ("MT_", _DT[meta_dtype] if meta_dtype != torch.float32 else 0), ("MINB_", minb), ("PART_", part),
            *((k, flags[k]) for k in sorted(flags)), ("ARCH", arch))


def _smem_bytes(key: tuple) -> int:
    """Dynamic shared memory of the split kernel of ``key``: CPA_'s page stages (NW_ x CP_WREG in the .cu), else 0."""
    k = dict(key)
    nst = k.get("CPA_", 0)
    if not nst:
        return 0
    d, ps = k["D_"], k["PS_"]
    msz = 4 if k["MT_"] == 0 else 2
    stage = 2 * ps * d // 4 + 4 * ps * msz  # K and V codes, four metadata rows
    return k["NW_"] * (-(-max(nst * stage, 8 * d * 4) // 128) * 128)


def build(key: tuple) -> Path:
    """Compile one configuration to a cubin (or reuse the cached one); returns its path."""
    src = _SRC.read_bytes()
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
    cmd = [exe, f"-arch=sm_{arch}", "-O3", "-std=c++17", "-cubin", *defs, "-o", str(tmp), str(_SRC)]
    res = subprocess.run(cmd, capture_output=True, text=True)
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
        if hasattr(self.lib, "cuLaunchKernelEx"):  # CUDA 12+ drivers; only the "pdl" variant uses it
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


@functools.lru_cache(maxsize=64)
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
        smem = _smem_bytes(key)
        if smem:  # CPA_: opt in to more than 48 KB of dynamic shared memory, and prefer shared memory over L1
            drv.check(drv.lib.cuFuncSetAttribute(fns[0], _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                      "cuFuncSetAttribute(max dynamic shared memory)")
            drv.check(drv.lib.cuFuncSetAttribute(fns[0], _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
                      "cuFuncSetAttribute(shared memory carveout)")
        return fns[0], fns[1]


def _struct(name: str, fields: list[tuple[str, object]]):
    return type(name, (ctypes.Structure,), {"_fields_": fields})


_P_FIELDS = ([(n, ctypes.c_uint64) for n in "q kc vc ks ko vs vo bt qlen k16 v16 len16 o_part lse_part".split()]
             + [(n, ctypes.c_int64) for n in ("sq_b sq_h s_cp s_ch s_mp s_mh s_bt s16_b s16_h s16_t so_b so_h so_s "
                                               "sl_b sl_h hkv tok_per_split num_qsplits tok16_per_split").split()]
             + [("sm_scale_log2", ctypes.c_double), ("magic", ctypes.c_int64)]
             + [(n, ctypes.c_uint64) for n in ("counters", "out")]
             + [(n, ctypes.c_int64) for n in ("merge_splits", "sout_b", "sout_h", "out_dtype", "gran_pages",
                                               "least_pages")])
_Params = _struct("_Params", _P_FIELDS)
_MergeParams = _struct("_MergeParams", [(n, ctypes.c_uint64) for n in ("o_part", "lse_part", "out")] + [
    (n, ctypes.c_int64) for n in "so_b so_h so_s sl_b sl_h sout_b sout_h hq num_splits out_dtype".split()])


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


def _validate(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan):
    from .decode_triton import _check_decode

    _check_decode(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan)
    fmt = k_pages.fmt
    if not supported(fmt):
        raise ValueError(f"the CUDA decode kernel does not support {fmt}: use backend='triton' or 'reference'")
    if k16.dtype not in (torch.float16, torch.bfloat16) or q.dtype not in _DT:
        raise ValueError(f"k16/v16 must be float16 or bfloat16 (got {k16.dtype}); q float32/16 (got {q.dtype})")
    if any(s % 8 for s in k16.stride()[:3]) or k16.data_ptr() % 16 or v16.data_ptr() % 16:
        raise ValueError("k16/v16 rows must be 16-byte aligned (strides multiple of 8 elements)")
    if fmt.row_bytes * fmt.page_size % 16 or k_pages.codes.stride(1) % 16 or k_pages.codes.stride(0) % 16:
        raise ValueError("code pages must be 16-byte aligned")
    pair = 2 * k_pages.scale.element_size()  # metadata of two adjacent rows is read as one load
    for t in (k_pages.scale, k_pages.offset, v_pages.scale, v_pages.offset):
        if t.data_ptr() % pair or t.stride(0) % 2 or t.stride(1) % 2:
            raise ValueError(f"scale/offset pages must be {pair}-byte aligned with even page and head strides")


def _cpa_aligned(k_pages: QuantPages, v_pages: QuantPages) -> bool:
    """CPA_ copies whole (page, head) blocks of codes and metadata rows in 16-byte pieces."""
    for pages in (k_pages, v_pages):
        es = pages.scale.element_size()
        if pages.codes.data_ptr() % 16 or pages.codes.stride(0) % 16 or pages.codes.stride(1) % 16:
            return False
        for t in (pages.scale, pages.offset):
            if t.data_ptr() % 16 or (t.stride(0) * es) % 16 or (t.stride(1) * es) % 16:
                return False
    return True


def _launch_variant(variant: str | None, units: int, pdl: bool, k_pages: QuantPages | None = None,
                    v_pages: QuantPages | None = None) -> str:
    """The variant a launch for ``units`` (sequence, KV head) pairs compiles (see :func:`decode_attention_cuda`):
    the default or ``variant``, with PDL's names, less what the pools cannot take (raises for an explicit
    ``variant``). Without pools: pools with page strides below 4 GiB and 16-byte aligned pages."""
    explicit = variant is not None
    variant = _resolve_variant(variant, units)
    if pdl:  # with the default's l2pf, also "early": its prefetch then runs before the wait, during the kernel before
        names = [*_variant_names(variant), "pdl", "pdlw"]
        if not explicit and "l2pf" in names:
            names.append("early")
        variant = "+".join(dict.fromkeys(names))
    flags = _variant_flags(variant)
    big = k_pages is not None and max(k_pages.codes.stride(0),
                                      k_pages.scale.stride(0) * k_pages.scale.element_size()) >= 2**32
    drop = []
    if flags["L2PF_"] and big:
        drop.append(("l2pf/early", "page strides below 4 GiB"))
    if flags["CPA_"] and (big or (k_pages is not None and not _cpa_aligned(k_pages, v_pages))):
        drop.append(("cpa/cpa3", "page strides below 4 GiB and 16-byte aligned code and metadata pages"))
    if drop:
        if explicit:
            raise ValueError("; ".join(f"variant '{n}' needs {why}" for n, why in drop))
        gone = {x for n, _ in drop for x in n.split("/")}  # the default / environment drops them
        variant = "+".join(v for v in _variant_names(variant) if v not in gone) or "none"
    return variant


def prebuild(fmt: PageFormat, num_q_heads: int, q_dtype: torch.dtype, dtype16: torch.dtype, max_batch: int, *,
             pdl: bool = False, workers: int | None = None) -> list[Path]:
    """Build (or find in the cache) every cubin the default launches of 1..``max_batch`` sequences can load:
    each variant (one sequence's few pairs, the rest) and launch shape (both tiers in one launch up to
    :data:`FUSED_UNITS` pairs, one per tier above), in parallel. A launch builds its cubin on first use, ~1.7 s of
    nvcc each on the H200 machine (session 17), so a server calls this at start instead of stalling its first
    requests. Returns the cubins' paths; none where the CUDA kernel does not serve these shapes."""
    g = num_q_heads // fmt.num_kv_heads
    if g > 8 or not supported(fmt, dtype16, q_dtype):
        return []
    keys: dict[tuple, None] = {}
    for b in range(1, max_batch + 1):
        units = b * fmt.num_kv_heads
        variant = _launch_variant(None, units, pdl)
        for part in ((0,) if units <= FUSED_UNITS else (1, 2)):
            keys[config_key(fmt.head_dim, g, fmt.page_size, q_dtype, dtype16, fmt.meta_dtype, part,
                            variant=variant)] = None
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
    plan: DecodePlan | None = None, out: Tensor | None = None, fused: bool | None = None, merge: str = "kernel",
    variant: str | None = None, pdl: bool = False,
) -> Tensor:
    """Decode attention with the CUDA C++ kernel; arguments and result as
    :func:`oscarkv.kernels.decode_triton.decode_attention_triton`. At most 8 query heads per KV head (larger
    groups go to the Triton kernel). ``fused``: both tiers in one launch, else one launch per tier (default:
    fused for at most 64 (sequence, KV head) pairs, where the extra launch costs more than the registers).
    ``merge``: ``"kernel"`` (a separate merge kernel, the default: measured faster at batch <= 8 and equal
    above, docs/results/kernels_h200.md) or ``"fused"`` (the last split of each (sequence, KV head) to finish
    combines the partials through the plan's ticket counters: no second launch, but a serial tail).
    ``variant``: compile-time variants of the 2-bit loop (:data:`VARIANTS`, joined by ``+``, e.g.
    ``"subn+lazy"``; ``""`` or ``"none"`` = none); None: ``$OSCARKV_CUDA_DECODE_VARIANT`` if set, else
    :data:`DEFAULT_VARIANT` (:data:`DEFAULT_VARIANT_FEW` for at most :data:`FEW_UNITS` (sequence, KV head)
    pairs), without "l2pf" / "cpa" for page strides of 4 GiB or more, where they cannot
    address, and without "cpa" for pages not 16-byte aligned (an explicit ``variant`` raises there).
    ``pdl``: launch the split kernel as a programmatic dependent of the previous kernel on the stream (it waits
    for that kernel at its start, so its launch and prologue overlap that kernel's tail), the merge kernel as a
    dependent of the split kernel, and let the next kernel start during the merge (variants "pdl" and "pdlw";
    the next kernel must itself wait, griddepcontrol.wait / Triton's gdc_wait, before touching the output).
    With the default variant, ``pdl`` also turns on "early" where "l2pf" is on (one sequence): each warp's first
    two pages are prefetched into L2 before the wait (H200, 8B engine step at batch 1: -0.04..0.06 ms at 32K-128K,
    e2e_h200.md session 15; without PDL, in the kernel benchmark, it measured within 2%)."""
    if merge not in ("fused", "kernel"):
        raise ValueError(f"merge must be 'fused' or 'kernel', got {merge!r}")
    variant = _launch_variant(variant, q.shape[0] * k_pages.fmt.num_kv_heads, pdl, k_pages, v_pages)
    B, hq, d = q.shape
    fmt = k_pages.fmt
    g = hq // fmt.num_kv_heads
    if g > 8:
        from .decode_triton import decode_attention_triton

        return decode_attention_triton(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale,
                                       plan=plan, out=out)
    if plan is None:
        plan = DecodePlan(B, hq, fmt.num_kv_heads, d, fmt.page_size, block_table.shape[1], k16.shape[2],
                          device=q.device)
    _validate(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan)
    if fused is None:
        fused = B * fmt.num_kv_heads <= FUSED_UNITS
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    if out.dtype not in _DT or out.shape != (B, hq, d) or out.stride(2) != 1:
        raise ValueError(f"out must be [{B}, {hq}, {d}] float32/float16/bfloat16 with unit last stride")
    o, lse = plan.o_part, plan.lse_part
    scale = float(d**-0.5 if sm_scale is None else sm_scale) * 1.4426950408889634
    p = _Params(
        q.data_ptr(), k_pages.codes.data_ptr(), v_pages.codes.data_ptr(), k_pages.scale.data_ptr(),
        k_pages.offset.data_ptr(), v_pages.scale.data_ptr(), v_pages.offset.data_ptr(), block_table.data_ptr(),
        qlen.data_ptr(), k16.data_ptr(), v16.data_ptr(), len16.data_ptr(), o.data_ptr(), lse.data_ptr(),
        q.stride(0), q.stride(1), k_pages.codes.stride(0), k_pages.codes.stride(1), k_pages.scale.stride(0),
        k_pages.scale.stride(1), block_table.stride(0), k16.stride(0), k16.stride(1), k16.stride(2),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), fmt.num_kv_heads,
        plan.pages_per_split * fmt.page_size, plan.num_qsplits, plan.tokens16_per_split, scale, 0x64006400,
        plan.counters.data_ptr() if merge == "fused" else 0, out.data_ptr(), plan.num_splits if merge == "fused" else 0,
        out.stride(0), out.stride(1), _DT[out.dtype], *plan.split_granule,
    )
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    parts = [(0, plan.num_splits)] if fused else [(1, plan.num_qsplits), (2, plan.num_splits16)]
    for part, nsplit in parts:
        if nsplit == 0:
            continue
        key = config_key(d, g, fmt.page_size, q.dtype, k16.dtype, fmt.meta_dtype, part, variant=variant)
        split_fn, _ = _functions(key, dev)
        _launch(split_fn, (nsplit, B * fmt.num_kv_heads), 32 * _NW, p, stream, smem=_smem_bytes(key),
                pdl=bool(dict(key)["PDLW_"]))
    if merge == "fused":
        return out
    mkey = config_key(d, g, fmt.page_size, q.dtype, k16.dtype, fmt.meta_dtype, parts[0][0], variant=variant)
    _, merge_fn = _functions(mkey, dev)
    mp = _MergeParams(o.data_ptr(), lse.data_ptr(), out.data_ptr(), o.stride(0), o.stride(1), o.stride(2),
                      lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), hq, plan.num_splits, _DT[out.dtype])
    # one CTA per (sequence, query head, 32 outputs), 256 threads: MERGE_SLICE / MERGE_THREADS in the .cu
    _launch(merge_fn, (B * hq * (d // 32), 1), 256, mp, stream, pdl=bool(dict(mkey)["PDL_"]))
    return out


__all__ = ["decode_attention_cuda", "supported", "build", "prebuild", "config_key", "nvcc"]

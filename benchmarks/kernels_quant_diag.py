"""GPU check of the quantize kernel against the CPU reference, per formulation variant: mismatch counts of
codes / scales / offsets (written slots only) and the first mismatching row. Small and quick."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oscarkv.kernels.layout import PageFormat, QuantPages  # noqa: E402
from oscarkv.kernels.quantize_triton import quantize_write_triton  # noqa: E402
from oscarkv.kernels.reference import quantize_write_ref  # noqa: E402
from oscarkv.quant import unpack  # noqa: E402


def run(hkv, n, d, clip, variant, meta=torch.float16, verbose=False, dev="cuda"):
    torch.manual_seed(0)
    fmt = PageFormat(num_kv_heads=hkv, head_dim=d, page_size=16, meta_dtype=meta)
    npages = n // 8 + 2
    kp = QuantPages.allocate(fmt, npages, dev)
    vp = QuantPages.allocate(fmt, npages, dev)
    kr = QuantPages.allocate(fmt, npages, "cpu")
    k = (torch.randn(n, hkv, d) * 4).to(torch.bfloat16)
    slots = torch.randperm(npages * 16)[:n]
    quantize_write_triton(kp, vp, k.to(dev), k.to(dev), slots.to(dev), k_clip=clip, v_clip=clip, variant=variant)
    quantize_write_ref(kr, k, slots, clip_ratio=clip)
    pg, rw = slots // 16, slots % 16
    got_c, ref_c = kp.codes.cpu()[pg, :, rw], kr.codes[pg, :, rw]
    got_s, ref_s = kp.scale.cpu()[pg, :, rw], kr.scale[pg, :, rw]
    got_o, ref_o = kp.offset.cpu()[pg, :, rw], kr.offset[pg, :, rw]
    bad_c = (got_c != ref_c).any(-1)
    bad_s = (got_s.view(torch.int16) != ref_s.view(torch.int16)).any(-1)
    bad_o = (got_o.view(torch.int16) != ref_o.view(torch.int16)).any(-1)
    print(f"hkv={hkv} n={n} d={d} clip={clip} {variant}: rows bad codes {int(bad_c.sum())} scale {int(bad_s.sum())} "
          f"offset {int(bad_o.sum())} of {n * hkv}", flush=True)
    if verbose and (bad_c | bad_s | bad_o).any():
        i, h = torch.nonzero(bad_c | bad_s | bad_o)[0].tolist()
        x = k[i, h].float()
        print("  row", i, "head", h, "slot", int(slots[i]), "x[:8]", x[:8].tolist())
        print("  scale got/ref", got_s[i, h].tolist(), ref_s[i, h].tolist(), "offset", got_o[i, h].tolist(),
              ref_o[i, h].tolist())
        gc, rc = unpack(got_c[i, h], 2), unpack(ref_c[i, h], 2)
        j = torch.nonzero(gc != rc).flatten()[:6].tolist()
        print("  code idx", j, "got", gc[j].tolist(), "ref", rc[j].tolist(), "x", x[j].tolist())
        # is the kernel page written at the right place at all?
        print("  got row equal to ref of some other (slot, head)?",
              bool((got_c[i, h] == kr.codes.reshape(-1, fmt.row_bytes)).all(-1).any()))


def main():
    for hkv, n, d, clip in ((1, 16, 64, 0.9), (1, 1000, 64, 0.9), (8, 16, 64, 0.9), (8, 1000, 64, 0.0),
                            (8, 1000, 128, 0.96)):
        for variant in ((), ("code_div",), ("clip_sort",)):
            run(hkv, n, d, clip, variant, verbose=variant == () and (hkv, n) == (8, 1000))
    run(8, 1000, 128, 0.96, (), meta=torch.bfloat16)


if __name__ == "__main__":
    main()

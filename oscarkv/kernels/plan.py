"""``DecodePlan``: split-K geometry and preallocated workspace for decode attention (pure PyTorch, no Triton).

Plan once per decode step (host integers only, no device synchronisation), run the kernels once per layer.
The workspace is sized for the largest batch and context at construction, so a plan can be captured inside a
CUDA graph: a replay reads sequence lengths and block tables from device memory, never from the host.

Splits of one (sequence, KV head): ``num_qsplits`` ranges of 2-bit pages, then ``num_splits16`` ranges of
``tokens16_per_split`` 16-bit-tier tokens. Each writes a partial output normalised by its own softmax sum and its
log-sum-exp (base 2); one merge kernel combines them.

The split count is planned for the longest 2-bit tier the step may hold; the kernels then cut each sequence's
own tier into that many ranges (:meth:`DecodePlan.split_tokens`: ``pages_per_split`` pages at most), so a
sequence shorter than the plan's bound still spreads over every split (a CUDA graph's plan is made for the
block table's capacity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass
class DecodePlan:
    """Split counts and workspace for :func:`oscarkv.kernels.decode_attention`.

    Args:
        max_batch: most sequences per call.
        num_q_heads, num_kv_heads, head_dim: attention geometry (``num_q_heads % num_kv_heads == 0``).
        page_size: tokens per 2-bit page.
        max_pages: width of the block table (most 2-bit pages of one sequence).
        max_len16: capacity ``C16`` of the 16-bit tier buffer.
        device: where the workspace lives.
        block_n: tokens per kernel iteration (a multiple of ``page_size`` or a divisor of it, at least 16).
        programs_per_sm: target grid size, in programs per multiprocessor, used to pick the split count.
            Default (None): 16 (about four waves of the CUDA kernel's four resident programs, which smooths
            the tail), except 4 (one wave) for a single sequence's KV heads, where short splits cost more in
            fixed work than they gain (docs/kernels.md).
        tokens16_per_split: 16-bit-tier tokens per split. Default (None): half the tier rounded up to 16, within
            [128, 256] (a 320-token tier: 2 splits of 160), so that a single sequence's quantized splits keep
            most of the program slots of one wave.
        warps_per_split: warps that share a split's pages (the CUDA kernel's 4); a split's page count is a
            multiple of it (when it has at least that many pages), so that no warp walks one page more than the
            others: the split's time is its slowest warp's.
        num_sms: multiprocessors to fill (default: read from the device).
        min_pages_per_split: lower bound on a split's length, so that short contexts do not pay a program's
            fixed cost (query setup, partial write) for a single page.

    Call :meth:`update` each step with the batch size and (optionally) the longest 2-bit tier in the batch; the
    result is deterministic in those two integers, so a CUDA graph captured for a (batch, max_tokens) bucket
    stays valid for every step inside that bucket.
    """

    max_batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_pages: int
    max_len16: int
    device: torch.device | str = "cpu"
    block_n: int | None = None
    programs_per_sm: int | None = None
    tokens16_per_split: int | None = None
    num_sms: int | None = None
    min_pages_per_split: int = 4
    warps_per_split: int = 4
    # filled by __post_init__ / update
    batch: int = field(init=False, default=0)
    pages_per_split: int = field(init=False, default=1)
    num_qsplits: int = field(init=False, default=1)
    num_splits16: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("max_batch", "page_size", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.device = torch.device(self.device)
        if self.block_n is None:
            self.block_n = max(16, self.page_size)
        bn, ps = self.block_n, self.page_size
        if bn < 16 or (bn % ps and ps % bn):
            raise ValueError(f"block_n {bn} must be >= 16 and a multiple or divisor of page_size {ps}")
        if self.num_sms is None:
            self.num_sms = _num_sms(self.device)
        if self.tokens16_per_split is None:
            half = -(-math.ceil(self.max_len16 / 2) // 16) * 16
            self.tokens16_per_split = min(256, max(128, half))
        self.num_splits16 = math.ceil(self.max_len16 / self.tokens16_per_split) if self.max_len16 else 0
        cap = self.max_pages * ps
        # workspace for the largest batch * splits over every batch size (the split count falls as batch grows)
        self.max_splits = max(1, self._splits_for(1, cap)[1] + self.num_splits16)
        rows = max(b * (self._splits_for(b, cap)[1] + self.num_splits16) for b in range(1, self.max_batch + 1))
        self._o_flat = torch.empty(rows * self.num_q_heads * self.head_dim, dtype=torch.float32, device=self.device)
        self._lse_flat = torch.empty(rows * self.num_q_heads, dtype=torch.float32, device=self.device)
        self.update(self.max_batch)

    @property
    def o_part(self) -> Tensor:
        """Partial outputs ``[batch, Hq, num_splits, d]`` float32 (a view of the preallocated workspace)."""
        n = self.batch * self.num_q_heads * self.num_splits * self.head_dim
        return self._o_flat[:n].view(self.batch, self.num_q_heads, self.num_splits, self.head_dim)

    @property
    def lse_part(self) -> Tensor:
        """Partial log-sum-exps (base 2) ``[batch, Hq, num_splits]`` float32."""
        n = self.batch * self.num_q_heads * self.num_splits
        return self._lse_flat[:n].view(self.batch, self.num_q_heads, self.num_splits)

    def _splits_for(self, batch: int, max_tokens: int) -> tuple[int, int]:
        """(pages_per_split, num_qsplits) for ``batch`` sequences of at most ``max_tokens`` 2-bit tokens."""
        ps, bn = self.page_size, self.block_n
        pages = max(1, math.ceil(max_tokens / ps))
        units = batch * self.num_kv_heads
        ppsm = self.programs_per_sm
        if ppsm is None:
            ppsm = 4 if units <= 8 else 16
        want = max(1, math.ceil(ppsm * self.num_sms / units))
        if want >= 4 * self.num_splits16:  # many 2-bit splits: leave room for the 16-bit ones in the same wave
            want -= self.num_splits16
        pps = max(math.ceil(pages / min(want, pages)), self.min_pages_per_split)
        nw = self.warps_per_split
        if pps >= nw:  # the fewest pages per warp those splits allow, every warp of a split the same count
            pps = max(math.ceil(pages / (min(want, pages) * nw)) * nw, math.ceil(self.min_pages_per_split / nw) * nw)
        step = max(1, bn // ps)  # a split covers whole kernel iterations
        pps = math.ceil(pps / step) * step
        return pps, math.ceil(pages / pps)

    @property
    def split_granule(self) -> tuple[int, int]:
        """(granule, least) in pages of the per-sequence split length (:meth:`split_tokens`): a split covers a
        multiple of ``granule`` pages (whole kernel iterations; every warp the same count once a split has
        ``warps_per_split`` pages) and at least ``least`` of them (``min_pages_per_split`` rounded up)."""
        step = max(1, self.block_n // self.page_size)
        gran = math.lcm(step, self.warps_per_split) if self.pages_per_split >= self.warps_per_split else step
        least = min(-(-self.min_pages_per_split // gran) * gran, self.pages_per_split)
        return gran, least

    def split_tokens(self, n_tokens: int) -> int:
        """2-bit tokens per split for a sequence whose 2-bit tier holds ``n_tokens``: its pages spread over the
        ``num_qsplits`` splits, in whole granules, at least the least split, at most ``pages_per_split`` pages
        (the bound the plan was made for). Split ``s`` covers ``[s t, min(n, (s + 1) t))``; the kernels compute
        the same from the sequence's length on the device (the host reference of that arithmetic)."""
        gran, least = self.split_granule
        pages = -(-int(n_tokens) // self.page_size)
        want = -(-pages // self.num_qsplits)
        pps = min(max(-(-want // gran) * gran, least), self.pages_per_split)
        return pps * self.page_size

    def update(self, batch: int, max_tokens: int | None = None) -> DecodePlan:
        """Set the split geometry for a step of ``batch`` sequences whose 2-bit tiers hold at most
        ``max_tokens`` tokens (default: the block table's capacity). Host arithmetic only."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside [1, max_batch={self.max_batch}]")
        cap = self.max_pages * self.page_size
        max_tokens = cap if max_tokens is None else min(int(max_tokens), cap)
        self.batch = batch
        self.pages_per_split, self.num_qsplits = self._splits_for(batch, max_tokens)
        rows = self._o_flat.numel() // (self.num_q_heads * self.head_dim)
        if batch * self.num_splits > rows:  # cannot happen for max_tokens <= capacity; guard the workspace
            self.pages_per_split, self.num_qsplits = self._splits_for(batch, cap)
        return self

    @property
    def num_splits(self) -> int:
        return self.num_qsplits + self.num_splits16


__all__ = ["DecodePlan"]

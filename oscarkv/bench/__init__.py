"""Benchmark support shared by ``oscarkv bench`` and the scripts under ``benchmarks/``: a cold-L2 timer,
provenance, and a correctness gate that refuses to time what does not match its reference (:mod:`.harness`);
the engine's end-to-end suites (:mod:`.e2e`) and their plots (:mod:`.plots`)."""

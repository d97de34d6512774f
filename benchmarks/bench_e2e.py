"""End-to-end engine benchmarks on a CUDA GPU: the same as ``oscarkv bench`` (see ``--help``, docs/gpu.md).

    python benchmarks/bench_e2e.py --out e2e.json
"""

import argparse
import sys

from oscarkv.cli import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))

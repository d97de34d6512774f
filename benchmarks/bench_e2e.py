"""End-to-end engine benchmarks on the GPU; see ``oscarkv bench --help`` and docs/engine.md.

    PYTHONPATH=. python3 benchmarks/bench_e2e.py --out e2e.json
"""

import argparse
import sys

from oscarkv.cli import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))

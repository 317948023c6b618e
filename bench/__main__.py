"""Run every benchmark in bench/ in turn: `python -m bench` (or `make bench`).

Each bench_<area>.py measures its target and its anchor in the same run and prints the ratio;
bench/RESULTS.md records the latest numbers with the command that produced them.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> int:
    only = set(sys.argv[1:])
    failed = []
    for path in sorted(Path(__file__).parent.glob("bench_*.py")):
        name = path.stem
        if only and name.removeprefix("bench_") not in only and name not in only:
            continue
        print(f"== {name}", flush=True)
        # Each benchmark parses sys.argv itself: it gets its own name alone, not this runner's filter.
        saved, sys.argv = sys.argv, [f"bench.{name}"]
        try:
            runpy.run_module(f"bench.{name}", run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                failed.append(name)
        finally:
            sys.argv = saved
    if failed:
        print(f"benchmarks that missed their target or failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

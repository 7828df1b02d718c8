"""`make bench [BENCH=name]`: runs benchmarks and ends with one JSON line
merging every benchmark's keys."""

import argparse
import json

BENCHES = ("engine", "http", "grammar", "prefix", "quant")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", default="all", choices=("all",) + BENCHES)
    args = parser.parse_args()
    results: dict = {}
    for name in BENCHES if args.bench == "all" else (args.bench,):
        module = __import__(f"benchmarks.{name}", fromlist=["run"])
        results.update(module.run())
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()

"""`make bench [BENCH=name]`: runs benchmarks and ends with one JSON line
merging every benchmark's keys with the machine's (CPU, serving dtype)."""

import argparse
import json

from .machine import machine_facts

BENCHES = ("engine", "http", "grammar", "structured", "prefix", "quant", "placement", "moe", "watermark", "lora",
           "kv_fp8", "speculate", "decode_attention", "image", "detokenize")
# Run only when named (not by "all"): `peers` installs and starts other servers.
OPT_IN = ("peers",)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", default="all", choices=("all",) + BENCHES + OPT_IN)
    args = parser.parse_args()
    facts = machine_facts()
    print("Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
    results: dict = dict(facts)
    for name in BENCHES if args.bench == "all" else (args.bench,):
        module = __import__(f"benchmarks.{name}", fromlist=["run"])
        results.update(module.run())
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()

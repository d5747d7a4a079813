"""Data-contract throughput: the `corpus` contract (Great Expectations, streamed in chunks)
vs plain streaming of the same corpus with the project's loader, measured in the same run.

A synthetic wiki-18-shaped corpus (ids "0".."N-1", contents "Title\\n~100 words") is written
to a temp folder; then

- baseline: `mempo.datasets.iter_corpus` reads and checks every line (what the index stage
  pays anyway);
- contract: `mempo.validation.validate_data("corpus", ...)` with the report and data docs
  (Great Expectations' import, ~3 s once per process, is timed apart).

    .venv/bin/python benchmarks/validation.py --quick     # 50k passages
    .venv/bin/python benchmarks/validation.py             # 500k passages

Writes benchmarks/results/validation.json and prints rows/s, the contract/baseline time
ratio, and the projected time for wiki-18's 21,015,324 passages at the measured rate.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WIKI18_PASSAGES = 21_015_324
WORDS = ("river city born founded company mayor capital painter engineer north south "
         "village country year museum bridge school river valley harbour").split()


def write_corpus(path: Path, n: int, seed: int = 0) -> int:
    """N passages of about 100 words; returns the file size in bytes."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(100))
            fh.write(json.dumps({"id": str(i), "contents": f"Title {i}\n{text}."}) + "\n")
    return path.stat().st_size


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="50k passages instead of 500k")
    ap.add_argument("--passages", type=int, default=None)
    ap.add_argument("--chunk-rows", type=int, default=100_000)
    args = ap.parse_args(argv)
    n = args.passages or (50_000 if args.quick else 500_000)
    logging.basicConfig(level=logging.WARNING)

    from mempo.config import ValidateParams
    from mempo.datasets import iter_corpus
    from mempo.validation import validate_data

    with tempfile.TemporaryDirectory(prefix="mempo-bench-validation-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        size = write_corpus(corpus, n)

        t0 = time.perf_counter()
        count = sum(1 for _ in iter_corpus(corpus))
        baseline_s = time.perf_counter() - t0
        assert count == n
        rss_after_baseline = _maxrss_mb()

        t0 = time.perf_counter()
        import great_expectations  # noqa: F401 - a one-off cost per process, reported apart

        ge_import_s = time.perf_counter() - t0
        params = ValidateParams(out=str(Path(tmp) / "reports"), chunk_rows=args.chunk_rows)
        t0 = time.perf_counter()
        [report] = validate_data("corpus", corpus, params)
        contract_s = time.perf_counter() - t0
        assert report.success and report.rows == n

    result = {
        "passages": n,
        "file_mb": round(size / 2**20, 1),
        "chunk_rows": args.chunk_rows,
        "frames": report.frames,
        "expectations": len(report.outcomes),
        "baseline_iter_corpus_s": round(baseline_s, 2),
        "baseline_rows_per_s": round(n / baseline_s),
        "ge_import_s": round(ge_import_s, 2),
        "contract_s": round(contract_s, 2),
        "contract_rows_per_s": round(n / contract_s),
        "contract_over_baseline_time": round(contract_s / baseline_s, 2),
        "projected_wiki18_contract_min": round(WIKI18_PASSAGES / (n / contract_s) / 60, 1),
        "max_rss_mb_after_baseline": round(rss_after_baseline),
        "max_rss_mb_after_contract": round(_maxrss_mb()),
        "quick": args.quick,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'':28s}{'seconds':>10s}{'rows/s':>12s}{'ratio':>8s}")
    print(f"{'baseline iter_corpus':28s}{baseline_s:10.2f}{n / baseline_s:12.0f}{1.0:8.2f}")
    print(f"{'corpus contract (GE)':28s}{contract_s:10.2f}{n / contract_s:12.0f}"
          f"{contract_s / baseline_s:8.2f}")
    print(f"projected for wiki-18 ({WIKI18_PASSAGES:,} passages): "
          f"{result['projected_wiki18_contract_min']} min; max RSS {result['max_rss_mb_after_contract']} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

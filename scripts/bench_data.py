"""The data pipeline from Parquet against JSONL: tokens/s and peak RSS over one epoch of a large file.

    python scripts/bench_data.py                        # a ~1 GB corpus in /tmp, 3 runs of each
    python scripts/bench_data.py --size 200MB --repeats 2 --out /tmp/bench_data

One synthetic corpus (documents of random words, ~4 KiB on average, with an ``id`` and a
``source`` column beside ``text``) is written once as JSONL and as Parquet (row groups of
``--row-group-mb``), both generated piece by piece. Each run is a child process that builds a
``BatchStream`` (data.format: text) over one of the files and takes batches until the epoch
ends, so the whole file passes through (byte tokenizer: the reading is measured, not a BPE);
the child's RSS is sampled from outside (``bench_child.run_sampled_child``: the process tree's
RSS and its ``VmHWM``). The contenders alternate run by run; the report gives the median and
range of tokens/s (batches taken after the index is built), index seconds, peak RSS and (the
child's own reading) the RSS after its imports. Prints one JSON object and writes
``docs/bench_data.json`` and ``docs/bench_data.png`` (``--out`` changes the stem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
CONTENDERS = ("jsonl", "parquet")


# ----------------------------------------------------------------------------- the corpus

def _word_pool(rng: np.random.Generator, nbytes: int) -> str:
    """A string of ``nbytes`` or more of random lowercase words (Zipf-like frequencies)."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    vocab = ["".join(map(chr, rng.choice(letters, size=int(n)))) for n in rng.integers(2, 11, size=20_000)]
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    picks = rng.choice(len(vocab), size=nbytes // 5, p=weights / weights.sum())
    return " ".join(vocab[i] for i in picks)


def write_corpus(folder: Path, size: int, row_group_mb: int, seed: int = 0) -> dict:
    """Writes ``corpus.jsonl`` (about ``size`` bytes) and ``corpus.parquet`` with the same
    documents, one row group's worth of documents at a time; returns what was written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    pool = _word_pool(rng, 64 * MIB)
    folder.mkdir(parents=True, exist_ok=True)
    jsonl, parquet = folder / "corpus.jsonl", folder / "corpus.parquet"
    written, docs, groups = 0, 0, 0
    schema = pa.schema([("id", pa.int64()), ("text", pa.string()), ("source", pa.string())])
    with open(jsonl, "w") as out, pq.ParquetWriter(parquet, schema) as writer:
        while written < size:
            texts, nbytes = [], 0
            while nbytes < row_group_mb * MIB and written + nbytes < size:
                length = int(np.clip(rng.lognormal(np.log(3000), 0.8), 200, 64 << 10))
                start = int(rng.integers(0, len(pool) - length))
                texts.append(pool[start:start + length])
                nbytes += length + 40
            ids = list(range(docs, docs + len(texts)))
            lines = [json.dumps({"id": i, "text": t, "source": "synthetic"}) for i, t in zip(ids, texts)]
            out.write("\n".join(lines) + "\n")
            writer.write_table(pa.table({"id": ids, "text": texts, "source": ["synthetic"] * len(texts)},
                                        schema=schema), row_group_size=len(texts))
            written += sum(len(line) + 1 for line in lines)
            docs, groups = docs + len(texts), groups + 1
    return {"documents": docs, "row_groups": groups, "jsonl_bytes": jsonl.stat().st_size,
            "parquet_bytes": parquet.stat().st_size, "row_group_mb": row_group_mb}


# ----------------------------------------------------------------------------- one run (the child)

def child(args: argparse.Namespace) -> None:
    """Builds a BatchStream over ``args.child`` and takes batches until its first epoch ends."""
    progress = open(args.progress, "a", buffering=1)
    from jaxascend.config import DataConfig
    from jaxascend.data import BatchStream, load_tokenizer

    tokenizer = load_tokenizer("byte")  # cheap: the reading, not a BPE, is measured
    imported_rss = psutil.Process().memory_info().rss  # python, numpy, pyarrow, jaxascend.data
    progress.write("imported\n")
    cfg = DataConfig(paths=[args.child], seq_len=args.seq_len, batch_size=args.batch_size)
    start = time.perf_counter()
    stream = BatchStream(cfg, tokenizer)
    index_s = time.perf_counter() - start
    progress.write("indexed\n")
    start, batches = time.perf_counter(), 0
    while stream.epoch == 0:
        next(stream)
        batches += 1
    read_s = time.perf_counter() - start
    tokens = batches * args.batch_size * (args.seq_len + 1)
    Path(args.result).write_text(json.dumps({
        "imported_rss_mib": imported_rss / MIB, "index_s": index_s, "read_s": read_s, "batches": batches,
        "tokens": tokens,
        "tokens_per_s": tokens / read_s, "documents": stream.num_documents, "bytes": stream.index.total_bytes}))
    progress.write("done\n")


def run_contender(name: str, path: Path, repeat: int, args: argparse.Namespace) -> dict:
    """One child run over ``path``, sampled from outside; its result and memory."""
    from bench_child import run_sampled_child

    work = Path(args.dir) / "runs" / f"{name}-{repeat}"
    work.mkdir(parents=True, exist_ok=True)
    progress, result = work / "progress", work / "result.json"
    for f in (progress, result):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", str(path), "--progress", str(progress), "--result", str(result),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]

    def lines() -> int:
        return len(progress.read_text().splitlines()) if progress.exists() else 0

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = run_sampled_child(cmd, str(work / "no-cache-files"), lines, work / "log.txt", steps=3, cwd=REPO,
                            interval=0.05, timeout=args.timeout, finish=True, env=env)
    out = json.loads(result.read_text())
    out.update(contender=name, repeat=repeat, peak_rss_mib=run.peak_rss / MIB,
               rss_trace=[(s[0], round(s[1] / MIB, 1)) for s in run.samples])
    return out


# ----------------------------------------------------------------------------- the report

def _spread(values: list[float], digits: int) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def summarize(runs: list[dict]) -> dict:
    table = {}
    for name in CONTENDERS:
        mine = [r for r in runs if r["contender"] == name]
        if mine:
            table[name] = {"runs": len(mine), "tokens_per_s": _spread([r["tokens_per_s"] for r in mine], 0),
                           "peak_rss_mib": _spread([r["peak_rss_mib"] for r in mine], 1),
                           "imported_rss_mib": _spread([r["imported_rss_mib"] for r in mine], 1),
                           "index_s": _spread([r["index_s"] for r in mine], 2),
                           "epoch_s": _spread([r["read_s"] for r in mine], 2)}
    return table


def plot(path: Path, report: dict, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"jsonl": "tab:orange", "parquet": "tab:blue"}
    fig, (trace, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for r in runs:
        t, rss = zip(*r["rss_trace"])
        trace.plot(t, rss, color=colors[r["contender"]], alpha=0.7,
                   label=r["contender"] if r["repeat"] == 0 else None)
    trace.set_xlabel("seconds since the child started (index, then one epoch)")
    trace.set_ylabel("RSS of the child (MiB)")
    trace.set_title("RSS, sampled from outside every 50 ms")
    trace.legend()
    names = list(report["contenders"])
    med = [report["contenders"][n]["tokens_per_s"]["median"] / 1e6 for n in names]
    err = [[m - report["contenders"][n]["tokens_per_s"]["min"] / 1e6 for m, n in zip(med, names)],
           [report["contenders"][n]["tokens_per_s"]["max"] / 1e6 - m for m, n in zip(med, names)]]
    bars.bar(names, med, yerr=err, capsize=6, color=[colors[n] for n in names])
    for k, n in enumerate(names):
        bars.annotate(f"peak RSS {report['contenders'][n]['peak_rss_mib']['median']:.0f} MiB",
                      (k, med[k]), ha="center", va="bottom", xytext=(0, 14), textcoords="offset points")
    bars.set_ylabel("million tokens/s (median, range)")
    bars.set_title(f"{report['tokenizer']} tokenizer, batch {report['batch_size']} x {report['seq_len'] + 1}")
    fig.suptitle(f"data pipeline over one epoch of {report['corpus']['jsonl_bytes'] / 1e9:.2f} GB "
                 f"({report['corpus']['documents']} documents), {report['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GB", help="the JSONL corpus's size (e.g. 1GB, 200MB)")
    p.add_argument("--row-group-mb", type=int, default=32, help="text per Parquet row group")
    p.add_argument("--dir", default="/tmp/jaxascend_bench_data", help="where the corpus and the runs go")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2047)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=str(REPO / "docs" / "bench_data"), help="the .json / .png stem")
    p.add_argument("--keep", action="store_true", help="keep the corpus files afterwards")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_context import simd_flags
    from bench_scale import cpu_model
    from jaxascend.config import parse_bytes

    folder = Path(args.dir)
    start = time.perf_counter()
    corpus = write_corpus(folder, parse_bytes(args.size, "--size"), args.row_group_mb)
    corpus["write_s"] = round(time.perf_counter() - start, 1)
    paths = {"jsonl": folder / "corpus.jsonl", "parquet": folder / "corpus.parquet"}
    runs = []
    for repeat in range(args.repeats):  # alternate which contender goes first
        for name in CONTENDERS if repeat % 2 == 0 else CONTENDERS[::-1]:
            runs.append(run_contender(name, paths[name], repeat, args))
            print(f"{name} #{repeat}: {runs[-1]['tokens_per_s'] / 1e6:.1f} M tokens/s, "
                  f"peak RSS {runs[-1]['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    report = {"issue": 30, "cpu": cpu_model(), "cpu_simd": simd_flags(), "cpus": os.cpu_count(),
              "tokenizer": "byte", "seq_len": args.seq_len, "batch_size": args.batch_size, "corpus": corpus,
              "contenders": summarize(runs),
              "runs": [{k: v for k, v in r.items() if k != "rss_trace"} for r in runs]}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    plot(Path(args.out + ".png"), report, runs)
    print(json.dumps(report))
    if not args.keep:
        for path in paths.values():
            path.unlink()


if __name__ == "__main__":
    main()

"""Times the data pipeline: index building, first batches, steady throughput, JSONL indexing.

    python scripts/bench_data.py                                 # tiny default: @stdlib *.py, bytes
    python scripts/bench_data.py --tokenizer bpe --batches 300   # a BPE tokenizer trained here
    python scripts/bench_data.py --jsonl-mb 200                  # also index a synthetic JSONL file

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from jaxascend.config import DataConfig
from jaxascend.data import BatchStream, build_document_index, load_tokenizer, write_hf_tokenizer


def _make_tokenizer(kind: str, tmp: str, cfg: DataConfig):
    if kind == "byte":
        return load_tokenizer("byte")
    index = build_document_index(DataConfig(paths=cfg.paths, include=cfg.include, max_documents=200))
    folder = write_hf_tokenizer(os.path.join(tmp, "bpe"), (index.read(i) for i in range(len(index))),
                                vocab_size=4096)
    return load_tokenizer(str(folder))


def _bench_jsonl(tmp: str, megabytes: int) -> dict:
    path = os.path.join(tmp, "synthetic.jsonl")
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 40, "meta": {"id": 1}}) + "\n"
    with open(path, "w") as f:
        for _ in range(megabytes * 2**20 // len(line)):
            f.write(line)
    start = time.perf_counter()
    index = build_document_index(DataConfig(paths=[path]))
    seconds = time.perf_counter() - start
    return {"jsonl_mb": megabytes, "jsonl_documents": len(index), "jsonl_index_s": round(seconds, 3),
            "jsonl_index_mb_per_s": round(megabytes / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=["@stdlib"])
    parser.add_argument("--include", nargs="+", default=["*.py"])
    parser.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--jsonl-mb", type=int, default=0, help="also index a synthetic JSONL file of this size")
    args = parser.parse_args()

    cfg = DataConfig(paths=args.paths, include=args.include, seq_len=args.seq_len, batch_size=args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _make_tokenizer(args.tokenizer, tmp, cfg)
        start = time.perf_counter()
        stream = BatchStream(cfg, tokenizer)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        first = next(stream)
        first_s = time.perf_counter() - start
        for _ in range(args.batches - 1):
            next(stream)
        batches_s = first_s + time.perf_counter() - start
        tokens = args.batches * first.size
        result = {
            "tokenizer": args.tokenizer, "vocab_size": tokenizer.vocab_size,
            "documents": stream.num_documents, "files": len(stream.index.files),
            "bytes": stream.index.total_bytes, "build_s": round(build_s, 3),
            "first_batch_s": round(first_s, 3), "batches": args.batches,
            "batches_s": round(batches_s, 3), "tokens_per_s": round(tokens / batches_s),
            "state": stream.state(),
        }
        if args.jsonl_mb:
            result.update(_bench_jsonl(tmp, args.jsonl_mb))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

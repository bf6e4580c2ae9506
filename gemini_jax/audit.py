"""The audit log's command line: check a log's hash chain, and optionally replay every turn.

    python -m gemini_jax.audit verify LOG [--replay] [--weights HF_DIR] [--max-seq-len N]
"""

from __future__ import annotations

import argparse
import sys

import gemini_jax as gj
from gemini_jax.session.audit import verify


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemini_jax.audit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check the hash chain (and optionally replay every record)")
    v.add_argument("log")
    v.add_argument("--replay", action="store_true", help="re-run each turn and compare result hashes")
    v.add_argument("--weights", default=None, help="HF weights dir (default: the shipped tiny model)")
    v.add_argument("--max-seq-len", type=int, default=4096)
    args = ap.parse_args(argv)
    engine = None
    if args.replay:
        model = gj.load_hf(args.weights) if args.weights else gj.load_tiny()
        engine = gj.Engine(model, gj.EngineConfig(max_seq_len=args.max_seq_len))
    ok, msg = verify(args.log, engine)
    print(("OK: " if ok else "FAILED: ") + msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

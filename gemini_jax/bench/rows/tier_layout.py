"""Row `tier_layout`: the disk tier's two layouts, one zarr3 chunk per (layer, page) ("chunked") vs
`shard_pages` pages of one layer per file ("sharded", zarr3 sharding_indexed), through
`gemini_jax.tiers.DiskStore`, side by side."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.tiers import DiskOptions, DiskStore, PageSpec, measure_disk

LAYOUTS = ("chunked", "sharded")


def _sizes(ctx: Context) -> dict:
    # One layer-page of a Llama-3-8B-shaped KV cache: 8 kv heads x 16 tokens x 128 dims, bf16 = 64 KiB.
    common = dict(shard_pages=64, workers=4, dir=None)  # dir None: a temp dir on /tmp's disk
    return ctx.pick(quick=dict(layers=2, num_pages=128, per_layer=16, append_rounds=16, repeats=2,
                               probe_mb=16, probe_seconds=0.5, **common),
                    full=dict(layers=8, num_pages=256, per_layer=32, append_rounds=64, repeats=5,
                              probe_mb=64, probe_seconds=1.0, **common))


def drop_cache(root: str) -> None:
    """Drop the file pages of every file under `root` from the page cache (posix_fadvise DONTNEED)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_layout(layout, spec, pages, reads, workdir, shard_pages, workers, append_rounds) -> dict:
    root = os.path.join(workdir, layout)
    shutil.rmtree(root, ignore_errors=True)
    out = {}
    # Decode-time write-through: every round appends one page to every layer and waits for it
    # (a sequence crossing a page boundary); a shard is rewritten for each page added to it.
    store = DiskStore(root + "_append", spec, DiskOptions(layout=layout, shard_pages=shard_pages, io_workers=workers))
    t0 = time.perf_counter()
    for p in range(append_rounds):
        for layer in range(spec.num_layers):
            store.put_stacked((layer, p), pages[(layer, p)])
        store.flush()
    out["append_s"] = time.perf_counter() - t0
    store.close()
    shutil.rmtree(root + "_append", ignore_errors=True)
    store = DiskStore(root, spec, DiskOptions(layout=layout, shard_pages=shard_pages, io_workers=workers))
    t0 = time.perf_counter()
    for key, data in pages.items():
        store.put_stacked(key, data)
    store.flush()
    out["write_s"] = time.perf_counter() - t0
    store.close()
    os.sync()
    out["files"] = sum(len(f) for _, _, f in os.walk(root))
    out["disk_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    store = DiskStore(root, spec, DiskOptions(layout=layout, shard_pages=shard_pages, io_workers=workers))
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_cache(root)
        t0 = time.perf_counter()
        for key in reads:
            store.get(key)
        out[f"read_serial_{mode}_s"] = time.perf_counter() - t0
        if mode == "cold":
            drop_cache(root)
        t0 = time.perf_counter()
        for f in [store.get_async(key) for key in reads]:
            f.result()
        out[f"read_parallel_{mode}_s"] = time.perf_counter() - t0
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


@row("tier_layout", about=(
    "Disk tier layout, chunked (one zarr3 chunk per layer-page) vs sharded (`shard_pages` pages of a layer "
    "per file), through `DiskStore`. Each repeat, for each layout in alternating order: append pages as "
    "decode does (one per layer, flush, repeat), write every page of a fresh store (put + flush), then "
    "read a random sparse selection (a decode step's cold fetches) with this store's file pages dropped "
    "from the page cache and again warm, one page at a time and `io_workers` in flight. Headline: median "
    "of per-repeat ratios sharded / chunked (throughput; > 1 = sharded faster); also the disk's own "
    "figures (`measure_disk`) and the default layout this picks."))
def tier_layout(ctx: Context) -> RowResult:
    s = _sizes(ctx)
    layers, num_pages, per_layer, repeats = s["layers"], s["num_pages"], s["per_layer"], s["repeats"]
    spec = PageSpec(num_layers=layers, num_pages=num_pages, kv_heads=8, block_size=16, head_dim=128,
                    dtype="bfloat16")
    rng = np.random.default_rng(ctx.seed)
    pages = {(l, p): rng.standard_normal((2, *spec.page_shape), dtype=np.float32).astype(spec.np_dtype)
             for l in range(layers) for p in range(num_pages)}
    workdir = tempfile.mkdtemp(prefix="gj_tier_layout_", dir=s["dir"])
    runs = {lay: [] for lay in LAYOUTS}
    try:
        disk = measure_disk(os.path.join(workdir, "probe"), file_mb=s["probe_mb"], seconds=s["probe_seconds"])
        for r in range(repeats):
            reads = [(l, int(p)) for l in range(layers) for p in rng.choice(num_pages, per_layer, replace=False)]
            order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
            for lay in order:
                runs[lay].append(one_layout(lay, spec, pages, reads, workdir, s["shard_pages"], s["workers"],
                                            s["append_rounds"]))
                print(f"repeat {r} {lay}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in runs[lay][-1].items()), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    n_pages, n_reads = layers * num_pages, layers * per_layer
    mb = spec.page_bytes / 1e6
    metrics = [("bulk write (prefill: put all pages, flush once)", "write_s", n_pages),
               ("append write (decode: 1 page per layer, flush, repeat)", "append_s", s["append_rounds"] * layers),
               ("cold random reads, one at a time", "read_serial_cold_s", n_reads),
               (f"cold random reads, {s['workers']} in flight", "read_parallel_cold_s", n_reads),
               ("warm random reads, one at a time", "read_serial_warm_s", n_reads),
               (f"warm random reads, {s['workers']} in flight", "read_parallel_warm_s", n_reads)]
    rows, recs = [], []
    for label, key, n in metrics:
        ch = [n / x[key] for x in runs["chunked"]]
        sh = [n / x[key] for x in runs["sharded"]]
        ratios = [a / b for a, b in zip(sh, ch)]
        med = {lay: statistics.median(v) for lay, v in (("chunked", ch), ("sharded", sh))}
        recs.append({"row": "tier_layout", "metric": key, "chunked_pages_s": med["chunked"],
                     "sharded_pages_s": med["sharded"], "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
        rows.append(f"| {label} | {med['chunked']:.0f} ({med['chunked'] * mb:.0f} MB/s) | "
                    f"{med['sharded']:.0f} ({med['sharded'] * mb:.0f} MB/s) | "
                    f"**{statistics.median(ratios):.2f}×** ({min(ratios):.2f}–{max(ratios):.2f}) |")
    m = {r["metric"]: r for r in recs}
    # The default is chosen on what a decode step waits for: cold reads (parallel, as the
    # prefetcher issues them) first, then decode-time writes (write-through traffic).
    cold, write = m["read_parallel_cold_s"]["ratio_median"], m["append_s"]["ratio_median"]
    better = "sharded" if cold > 1.05 and write > 0.95 else "chunked" if cold < 0.95 or write < 0.95 else "chunked"
    files = {lay: statistics.median(x["files"] for x in runs[lay]) for lay in LAYOUTS}
    size = {lay: statistics.median(x["disk_bytes"] for x in runs[lay]) / 1e6 for lay in LAYOUTS}
    recs.append({"row": "tier_layout", "metric": "summary", "default": better, "spec": spec.__dict__,
                 "page_bytes": spec.page_bytes, "repeats": repeats, "shard_pages": s["shard_pages"],
                 "workers": s["workers"], "disk": disk, "runs": runs})
    md = [
        f"Pages: {layers} layers x {num_pages} pages of [8 kv heads, 16 tokens, 128 dims] bf16 = "
        f"{spec.page_bytes // 1024} KiB each ({n_pages * spec.page_bytes / 1e6:.0f} MB per store). "
        f"Reads: {per_layer} random pages of every layer ({n_reads} pages), fresh per repeat, the same for "
        f"both layouts. Sharded: {s['shard_pages']} pages of one layer per file. Each repeat runs both "
        f"layouts (order alternating); figures are medians over {repeats} repeats, the ratio is the "
        f"median of per-repeat ratios (min–max). 'cold' = this store's file pages dropped from the page "
        f"cache before reading (posix_fadvise DONTNEED); the device behind the file system may cache too.",
        "",
        "| operation | chunked pages/s | sharded pages/s | sharded / chunked |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        f"Files per store: chunked {files['chunked']:.0f}, sharded {files['sharded']:.0f}; bytes on disk "
        f"(apparent): chunked {size['chunked']:.1f} MB, sharded {size['sharded']:.1f} MB.",
        "",
        f"This file system, measured through tensorstore (`measure_disk`, label 'measured'): sequential read "
        f"{disk['disk_read_gbs']:.2f} GB/s, {disk['io_bytes']}-byte random reads {disk['disk_iops']:.0f} IOPS "
        f"at queue depth {disk['queue_depth']} (cache dropped: {disk['cache_dropped']}).",
        "",
        f"**Default: `{better}`** (rule: sharded only if it reads cold pages >5% faster in parallel without "
        f"appending >5% slower).",
    ]
    return RowResult(records=recs, markdown="\n".join(md))

"""Files too large for one device call, packed into the folders several calls carry.

A device call carries the working tree and at most 64 MiB in all; MLX's CUDA wheel
alone is 89.8 MB. ``pack`` cuts the files into parts that fill the calls in order
(``carry/call1``, ``carry/call2``, ...), each call's folder under ``--budget`` bytes, and
writes ``manifest.json`` (every part's and every whole file's sha256) into each folder.
On the device, each call copies its folder into one stash (run.sh), and ``join``
checks every part, joins them and checks every file.

    python benchmarks/gpu/pack.py pack --budget BYTES --out benchmarks/gpu/carry FILE...
    python benchmarks/gpu/pack.py join STASH OUT     # one line per file; exit 1 on a miss
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
SMALLEST_PART = 1 << 20  # a call with less room left than this starts the next one


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def plan(sizes: dict[str, int], budget: int) -> list[list[tuple[str, int, int]]]:
    """Per call, its parts ``(file, start, length)``: files in order, cut where a call
    is full (``budget`` bytes, less its manifest's room)."""
    room = budget - 64 * 1024  # the manifest
    calls, current, left = [], [], room
    for name, size in sizes.items():
        start = 0
        while start < size:
            if left < min(SMALLEST_PART, size - start):
                calls.append(current)
                current, left = [], room
            length = min(size - start, left)
            current.append((name, start, length))
            start, left = start + length, left - length
    return calls + ([current] if current else [])


def pack(files: list[Path], budget: int, out: Path) -> dict:
    """Write the parts and the manifest under ``out``; returns the manifest."""
    sizes = {f.name: f.stat().st_size for f in files}
    by_name = {f.name: f for f in files}
    calls = plan(sizes, budget)
    shutil.rmtree(out, ignore_errors=True)
    manifest = {"budget": budget, "calls": len(calls), "files": {}}
    for f in files:
        manifest["files"][f.name] = {"bytes": sizes[f.name], "sha256": sha256(f), "parts": []}
    for i, parts in enumerate(calls, start=1):
        folder = out / f"call{i}"
        folder.mkdir(parents=True)
        for name, start, length in parts:
            entry = manifest["files"][name]
            part = folder / f"{name}.part{len(entry['parts']) + 1}"
            with open(by_name[name], "rb") as src, open(part, "wb") as dst:
                src.seek(start)
                dst.write(src.read(length))
            entry["parts"].append(
                {"name": part.name, "call": i, "bytes": length, "sha256": sha256(part)}
            )
    for i in range(1, len(calls) + 1):
        (out / f"call{i}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def join(stash: Path, out: Path) -> list[str]:
    """Check the parts copied into ``stash``, join them into ``out`` and check each
    file; returns the problems (empty when every file is whole)."""
    manifest = json.loads((stash / MANIFEST).read_text())
    problems = []
    out.mkdir(parents=True, exist_ok=True)
    for name, entry in manifest["files"].items():
        missing = [p for p in entry["parts"] if not (stash / p["name"]).is_file()]
        if missing:
            calls = sorted({p["call"] for p in missing})
            problems.append(f"{name}: parts of call {', '.join(map(str, calls))} are missing")
            continue
        bad = [p["name"] for p in entry["parts"] if sha256(stash / p["name"]) != p["sha256"]]
        if bad:
            problems.append(f"{name}: {', '.join(bad)} changed (sha256)")
            continue
        with open(out / name, "wb") as dst:
            for p in entry["parts"]:
                with open(stash / p["name"], "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if sha256(out / name) != entry["sha256"]:
            problems.append(f"{name}: joined file's sha256 differs")
        else:
            print(f"{name}: {entry['bytes'] / 2**20:.1f} MiB from {len(entry['parts'])} parts, "
                  f"sha256 ok")  # fmt: skip
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--budget", type=int, required=True, help="bytes per call's folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("files", type=Path, nargs="+")
    j = sub.add_parser("join")
    j.add_argument("stash", type=Path)
    j.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        manifest = pack(args.files, args.budget, args.out)
        for i in range(1, manifest["calls"] + 1):
            size = sum(f.stat().st_size for f in (args.out / f"call{i}").iterdir())
            print(f"call{i}: {size / 2**20:.1f} MiB")
        return 0
    problems = join(args.stash, args.out)
    for line in problems:
        print(f"join: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

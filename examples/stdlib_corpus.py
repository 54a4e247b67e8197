"""Write a training corpus for finetune_llama.py's `--data` from the Python standard library's own source files: text
every machine with Python has, no download (the GPU machine has no network), large enough that 200 steps of 16 x 1024
byte tokens (3.3M) do not see the same text over and over (the bundled examples/data/corpus.txt is 60 KB).

Output: a .jsonl file, one document per line {"text": <a .py file's source>, "path": <its path in the stdlib>}.
Documents: every .py file under sysconfig's "stdlib" folder (site-packages left out) that decodes as UTF-8 and is at
most --max-file-bytes long, in a fixed order that does not depend on the file system: sorted by the SHA-1 of the
relative path (packages interleaved, so the example's held-out tail — the last tokens — is not one package), cut
after --max-bytes bytes of text. The same Python version gives the same file, byte for byte.

Run: python examples/stdlib_corpus.py OUT.jsonl [--max-bytes 16000000] [--max-file-bytes 200000]
"""
import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path


def stdlib_documents(max_bytes: int, max_file_bytes: int) -> list[dict]:
    """The corpus's documents in their fixed order (see the module docstring).

    Args:
        max_bytes: stop after this many bytes of source text in total.
        max_file_bytes: leave out files larger than this (generated data tables such as pydoc_data/topics.py).
    Returns:
        [{"text": source, "path": path relative to the stdlib folder}, ...].
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in root.rglob("*.py")
             if p.relative_to(root).parts[0] not in ("site-packages", "dist-packages") and p.is_file()]
    paths.sort(key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    documents, total = [], 0
    for path in paths:
        raw = path.read_bytes()
        if len(raw) > max_file_bytes:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # (a few test files carry other encodings on purpose)
            continue
        documents.append({"text": text, "path": path.relative_to(root).as_posix()})
        total += len(raw)
        if total >= max_bytes:
            break
    return documents


def main(argv: list[str] | None = None) -> dict:
    """Write the corpus; returns {"path", "documents", "bytes", "python"} (also printed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--max-bytes", type=int, default=16_000_000, help="total source bytes (default 16 MB)")
    parser.add_argument("--max-file-bytes", type=int, default=200_000, help="largest file taken (default 200 KB)")
    args = parser.parse_args(argv)
    if not args.out.endswith(".jsonl"):
        parser.error(f"out: expected a path ending in .jsonl (finetune_llama.py reads .jsonl as documents), got "
                     f"{args.out!r}")
    if args.max_bytes <= 0 or args.max_file_bytes <= 0:
        parser.error("--max-bytes and --max-file-bytes: expected positive integers")
    documents = stdlib_documents(args.max_bytes, args.max_file_bytes)
    with open(args.out, "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps(doc) + "\n")
    info = {"path": args.out, "documents": len(documents), "bytes": sum(len(d["text"].encode()) for d in documents),
            "python": sys.version.split()[0]}
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    main()

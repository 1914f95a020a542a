"""attnres-prepare: local text -> token files that `data=tokens data.path=OUT_DIR` reads.

    attnres-prepare SRC OUT_DIR [--vocab-size N | --tokenizer FILE] [--workers N] [--val-fraction F]

SRC is `stdlib` (the Python standard library's source, as `data=stdlib` reads it), a file, a
folder (read recursively, hidden files skipped) or a glob (`**` recurses). `.jsonl` files hold one
JSON document per line (field `--text-field`, default `text`), `.parquet` files a text column of
that name (needs pyarrow), anything else is UTF-8 text, one document per file (files that are not
UTF-8 are skipped with a warning). The split is the byte corpus's: several text files go to
validation by a stable hash of their path (so `stdlib` splits exactly as `data=stdlib` does), a
single text file by position (its last `val_fraction`), JSONL and Parquet documents by a hash of
their text (duplicates land on one side).

The tokenizer is a byte-level BPE of `--vocab-size` trained here on the training split (Hugging
Face `tokenizers`; at most `--train-bytes` of it), or a local `tokenizer.json` (`--tokenizer`).
Nothing is downloaded. Each document is followed by an end-of-text token (`<|endoftext|>`).

Writes OUT_DIR/train.bin and val.bin (headered shards: 256 int32 of magic, version and token
count, then uint16 tokens, or uint32 above 65,536 tokens), tokenizer.json and meta.json (vocabulary,
tokenizer, token and byte counts, the source's content fingerprint). Streaming: files are read in
chunks of at most `sources.CHUNK_BYTES`, encoded by `--workers` processes and appended in source order, so
the output does not depend on the number of workers. Atomic: everything is written in a temporary
folder inside OUT_DIR and moved into place at the end, meta.json last.

The source's files, their tasks and documents are listed and read in `sources.py`.
"""


from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from attnres.config.errors import ConfigError
from attnres.data.shards import HEADER_BYTES, shard_header
from attnres.data.sources import Task, documents, list_source, make_tasks

log = logging.getLogger("attnres.prepare")

EOT = "<|endoftext|>"
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
OUTPUTS = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
STALE_TEMP_S = 3600

# -- encoding (in worker processes) ----------------------------------------------------------------
_WORKER: dict = {}


def _exit_with(parent: int) -> None:
    """A worker's watch: exit once `parent` is gone (a SIGKILLed parent closes nothing, and the pool's
    queues keep both ends of their pipes open in every worker, so nothing else would tell it)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _init_worker(tokenizer_json: str, eot_id: int | None, text_field: str, val_fraction: float,
                 dtype: str) -> None:
    global _VAL_FRACTION
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    if multiprocessing.parent_process() is not None:  # a worker process: end with the parent, even a killed one
        parent = multiprocessing.parent_process().pid  # not getppid(): the parent may be dead already (pid 1 then)
        with contextlib.suppress(Exception):  # Linux: the kernel kills it the moment the parent dies
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that
            os._exit(1)
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()  # elsewhere: within 0.5 s
    from tokenizers import Tokenizer

    _VAL_FRACTION = val_fraction
    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json), eot=eot_id, field=text_field, dtype=dtype)


def encode_task(task: Task) -> dict:
    """Tokens and byte counts of one task, per split; `skipped` when a text piece is not UTF-8."""
    tok, eot, dtype = _WORKER["tokenizer"], _WORKER["eot"], _WORKER["dtype"]
    out = {"train": [], "val": [], "train_bytes": 0, "val_bytes": 0, "docs": 0, "skipped": False,
           "sha": hashlib.sha256()}
    try:
        docs = list(documents(task, _WORKER["field"]))
    except UnicodeDecodeError:
        return {**out, "skipped": True, "train": _empty(dtype), "val": _empty(dtype), "sha": ""}
    by_split: dict[str, list[bytes]] = {"train": [], "val": []}
    for split, data in docs:
        by_split[split].append(data)
        out["sha"].update(data)
    for split, texts in by_split.items():
        if not texts:
            out[split] = _empty(dtype)
            continue
        encoded = tok.encode_batch([t.decode("utf-8") for t in texts], add_special_tokens=False)
        ids: list[int] = []
        for k, enc in enumerate(encoded):
            ids += enc.ids
            if eot is not None and (task.kind != "text" or (task.last and k == len(encoded) - 1)):
                ids.append(eot)
        out[split] = np.asarray(ids, dtype=dtype)
        out[f"{split}_bytes"] = sum(len(t) for t in texts)
        out["docs"] += len(texts)
    out["sha"] = out["sha"].hexdigest()
    return out


def _empty(dtype: str) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


# -- the tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(tasks: list[Task], vocab_size: int, text_field: str, max_bytes: int):
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes, <|endoftext|> and merges) trained on
    the training documents, at most `max_bytes` of them, read in source order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ConfigError(f"--vocab-size {vocab_size} is below 258 (256 bytes, <|endoftext|> and a merge); "
                          "pass e.g. --vocab-size 1024")

    def texts() -> Iterator[str]:
        seen = 0
        for task in tasks:
            try:
                for split, data in documents(task, text_field):
                    if split == "train":
                        yield data.decode("utf-8")
                        seen += len(data)
            except UnicodeDecodeError:
                continue
            if seen >= max_bytes:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    return tok


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer {path} is not a file; pass a local tokenizer.json "
                          "(nothing is downloaded), or --vocab-size N to train one here")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises its own exception type
        raise ConfigError(f"--tokenizer {path} is not a tokenizers JSON file ({err}); "
                          "pass a tokenizer.json saved by Hugging Face tokenizers") from err


# -- writing ------------------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _mark_owner(tmp: Path) -> None:
    """The temporary folder names the process writing it, so that the next run can tell a killed
    writer's folder (removed at once) from a live one's (left alone)."""
    (tmp / "owner.json").write_text(json.dumps({"pid": os.getpid(), "start": _process_start(os.getpid())}))


def remove_stale(out_dir: Path) -> None:
    """Remove the temporary folders of earlier runs into `out_dir` whose writer has ended (killed):
    at once when the folder names its writer, else after STALE_TEMP_S."""
    cutoff = time.time() - STALE_TEMP_S
    for tmp in out_dir.glob(".prepare-*.tmp"):
        try:
            owner = json.loads((tmp / "owner.json").read_text()) if (tmp / "owner.json").is_file() else None
            ended = owner is not None and _process_start(int(owner["pid"])) != owner.get("start")
            if ended or tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp)
        except (OSError, ValueError, KeyError, TypeError):
            pass


def prepare(src: str, out_dir: str, vocab_size: int | None = None, tokenizer: str | None = None,
            workers: int | None = None, val_fraction: float = 0.05, text_field: str = "text",
            max_files: int | None = None, train_bytes: int = 1 << 30, overwrite: bool = False,
            progress: bool | None = None) -> dict:
    """Write OUT_DIR/train.bin, val.bin, tokenizer.json and meta.json; returns meta.json's content."""
    global _VAL_FRACTION
    if (vocab_size is None) == (tokenizer is None):
        raise ConfigError("pass exactly one of --vocab-size N (train a byte-level BPE here) and "
                          "--tokenizer FILE (a local tokenizer.json)")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {val_fraction} must lie in (0, 1); e.g. --val-fraction 0.05")
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be >= 1")
    out = Path(out_dir).expanduser()
    held = [name for name in OUTPUTS[:2] + OUTPUTS[3:] if (out / name).exists()]
    if held and not overwrite:
        raise ConfigError(f"{out} already holds {', '.join(held)}; pass --overwrite to replace them, "
                          "or another OUT_DIR")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT_DIR {out} is a file; pass a folder")
    t0 = time.perf_counter()
    root, files = list_source(src, max_files)
    tasks = make_tasks(files, val_fraction)
    _VAL_FRACTION = val_fraction
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        log.info("training a %d-token byte-level BPE on the training split (at most %.0f MB)", vocab_size,
                 train_bytes / 1e6)
        tok = train_tokenizer(tasks, vocab_size, text_field, train_bytes)
    trained_s = time.perf_counter() - t0
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and vocab < vocab_size:  # BPE stops when no pair of tokens is left to merge
        log.warning("the vocabulary has %s tokens, not the %s asked for: the training text has no more pairs to "
                    "merge; a larger corpus gives more, or pass --vocab-size %d to ask for what it has",
                    f"{vocab:,}", f"{vocab_size:,}", vocab)
    eot_id = next((tok.token_to_id(t) for t in EOT_CANDIDATES if tok.token_to_id(t) is not None), None)
    if eot_id is None:
        log.warning("the tokenizer has no end-of-text token (%s): documents are concatenated without one",
                    ", ".join(EOT_CANDIDATES))
    dtype = "uint16" if vocab <= 2**16 else "uint32"

    out.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", suffix=".tmp", dir=out))
    _mark_owner(tmp)
    total = sum(f.size for f in files)
    old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup in `finally`, then exit 143
    try:
        sinks = {split: open(tmp / f"{split}.bin", "wb") for split in ("train", "val")}
        for sink in sinks.values():
            sink.write(b"\0" * HEADER_BYTES)  # the header is written once the count is known
        counts = {"train": 0, "val": 0, "train_bytes": 0, "val_bytes": 0, "docs": 0}
        fingerprint, skipped = hashlib.sha256(), set()
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, dynamic_ncols=True,
                   disable=None if progress is None else not progress)  # None: only on a terminal
        start = time.perf_counter()
        args = (tok.to_str(), eot_id, text_field, val_fraction, dtype)
        for task, result in zip(tasks, _results(tasks, workers, args), strict=True):
            if result["skipped"]:
                skipped.add(task.rel)
            for split in ("train", "val"):
                sinks[split].write(result[split].tobytes())
                counts[split] += len(result[split])
                counts[f"{split}_bytes"] += result[f"{split}_bytes"]
            counts["docs"] += result["docs"]
            fingerprint.update(f"{task.rel}:{task.start}:{result['sha']}\n".encode())
            bar.update(task.nbytes)
            elapsed = time.perf_counter() - start
            if elapsed > 0:
                bar.set_postfix_str(f"{(counts['train'] + counts['val']) / elapsed:,.0f} tokens/s", refresh=False)
        bar.close()
        for split, sink in sinks.items():
            sink.seek(0)
            sink.write(shard_header(np.dtype(dtype), counts[split]).tobytes())
            sink.flush()
            os.fsync(sink.fileno())
            sink.close()
        if counts["train"] == 0 or counts["val"] == 0:
            empty = "train" if counts["train"] == 0 else "validation"
            raise ConfigError(f"the {empty} split of {src!r} is empty ({len(files)} file(s), {len(skipped)} not "
                              "UTF-8); add text or change --val-fraction")
        encode_s = time.perf_counter() - start
        tok.save(str(tmp / "tokenizer.json"))
        meta = {
            "format": "attnres-prepare/1", "vocab_size": vocab, "dtype": dtype,
            "tokenizer": {"trained": tokenizer is None, "source": os.path.abspath(tokenizer) if tokenizer else None,
                          "type": "byte-level BPE" if tokenizer is None else "loaded", "eot_id": eot_id,
                          "trained_on_bytes_at_most": train_bytes if tokenizer is None else None},
            "tokenizer_file": "tokenizer.json",
            "train_tokens": counts["train"], "val_tokens": counts["val"],
            "train_bytes": counts["train_bytes"], "val_bytes": counts["val_bytes"],
            "documents": counts["docs"],
            "bytes_per_token": {split: round(counts[f"{split}_bytes"] / max(counts[split], 1), 4)
                                for split in ("train", "val")},
            "source": {"spec": src, "root": os.path.abspath(root), "files": len(files), "bytes_read": total,
                       "skipped_not_utf8": sorted(skipped), "fingerprint": fingerprint.hexdigest(),
                       "val_fraction": val_fraction, "text_field": text_field},
            "timing": {"tokenizer_s": round(trained_s, 2), "encode_s": round(encode_s, 2), "workers": workers,
                       "mb_per_s": round(total / 1e6 / max(encode_s, 1e-9), 2)},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if (out / "meta.json").exists():
            (out / "meta.json").unlink()  # a folder without meta.json is not a finished one
        for name in OUTPUTS:  # meta.json last
            os.chmod(tmp / name, 0o644)
            os.replace(tmp / name, out / name)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for sink in locals().get("sinks", {}).values():
            sink.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if skipped:
        log.warning("skipped %d file(s) that are not UTF-8 text: %s%s", len(skipped), ", ".join(sorted(skipped)[:5]),
                    ", ..." if len(skipped) > 5 else "")
    return meta


def _results(tasks: list[Task], workers: int, args: tuple, encode=None) -> Iterator[dict]:
    """encode(task) (default `encode_task`) for each task, in order. Several workers: fresh (spawned)
    processes, so nothing of this process's threads or locks is copied into them (a fork of a
    threaded process can hang); at most 2 tasks per worker in flight, so finished results never
    pile up in memory; a worker that dies (killed, out of memory) stops the run with an error
    instead of leaving it waiting forever; workers exit when the parent does, even a killed one."""
    if workers == 1:
        _init_worker(*args)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # in this process Ctrl-C must still stop it
        yield from map(encode or encode_task, tasks)
        return
    encode = encode or encode_task
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=args)
    pending: deque = deque()
    todo = iter(tasks)
    try:
        for task in todo:
            pending.append(pool.submit(encode, task))
            if len(pending) >= 2 * workers:
                break
        while pending:
            try:
                result = pending.popleft().result()
            except BrokenProcessPool:
                raise RuntimeError(f"an encoding worker died (killed, or out of memory?); nothing was written; "
                                   f"run again, with fewer --workers than {workers} if memory is short") from None
            task = next(todo, None)
            if task is not None:
                pending.append(pool.submit(encode, task))
            yield result
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="attnres-prepare", description="Tokenize local text into train.bin / val.bin for data=tokens "
        "(nothing is downloaded).")
    parser.add_argument("src", metavar="SRC", help="stdlib, a file, a folder or a glob (.txt and other text, .jsonl, "
                        ".parquet)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where train.bin, val.bin, tokenizer.json, meta.json go")
    parser.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this many tokens on the train split")
    parser.add_argument("--tokenizer", help="use this local tokenizer.json instead")
    parser.add_argument("--workers", type=int, default=None, help="encoding processes (default: all CPU cores)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held-out share (default 0.05)")
    parser.add_argument("--text-field", default="text", help="the text field of .jsonl / column of .parquet")
    parser.add_argument("--max-files", type=int, default=None, help="only the first N files in sorted order")
    parser.add_argument("--train-bytes", type=int, default=1 << 30,
                        help="train the tokenizer on at most this many bytes of the train split (default 1 GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in OUT_DIR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="attnres-prepare: %(message)s")
    try:
        meta = prepare(args.src, args.out_dir, args.vocab_size, args.tokenizer, args.workers, args.val_fraction,
                       args.text_field, args.max_files, args.train_bytes, args.overwrite)
    except ConfigError as err:
        print(f"attnres-prepare: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("attnres-prepare: interrupted; nothing was written to OUT_DIR", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as err:
        print(f"attnres-prepare: error: {err}", file=sys.stderr)
        sys.exit(1)
    t = meta["timing"]
    print(f"wrote {args.out_dir}: train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens "
          f"(vocabulary {meta['vocab_size']:,}, {meta['bytes_per_token']['train']} bytes/token) from "
          f"{meta['source']['bytes_read'] / 1e6:.1f} MB in {t['encode_s']:.1f} s ({t['mb_per_s']} MB/s, "
          f"{t['workers']} worker(s)); train with: attnres-run data=tokens data.path={args.out_dir}")


if __name__ == "__main__":
    main()

"""attnres's own lm-eval tasks, over local data generated from a run's own data module.

- `attnres_pointer` (a): multi-hop pointer chasing (`data=synthetic`) as multiple choice, on a
  stream of examples no run trains or validates on (`TASK_STREAM`), in words of a word-level
  tokenizer (`symbol_tokenizer`: k3 a key, v3 a value, Q, A, <pad>).
- `attnres_next_line` (b): which of four lines comes next, over the held-out (validation) text of a
  byte-level run.
- `attnres_bpb` (c): bits per byte of the text the runner's `val/bpb` reads, by loglikelihood_rolling.

Each task's documents are a JSON-lines file written into its own folder under
`$ATTNRES_CACHE/tasks/` (whole or absent: `attnres.atomic`), beside a copy of its YAML (`yaml/`)
whose `data_files` is that file's absolute path: lm-eval resolves a relative one against the
working folder. `lm_eval --include_path <that folder>` reads the same task.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from attnres.atomic import atomic_write
from attnres.config.errors import ConfigError
from attnres.data import corpus

OWN_TASKS = ("attnres_pointer", "attnres_next_line", "attnres_bpb")
TASK_STREAM = 2  # data.common: 0 trains, 1 validates; this one is neither
YAML = Path(__file__).parent / "yaml"
MAX_LINE = 80  # bytes of a line that may be a choice of attnres_next_line


def task_root() -> Path:
    return corpus.default_cache_dir() / "tasks"


def symbol_names(num_symbols: int) -> list[str]:
    """The word of each token of `data=synthetic` (its vocabulary, in id order)."""
    return [f"k{s}" for s in range(num_symbols)] + [f"v{s}" for s in range(num_symbols)] + ["<pad>", "Q", "A"]


def symbol_tokenizer(num_symbols: int) -> Any:
    """A word-level `tokenizers.Tokenizer` over `symbol_names`: words split at spaces, one token each."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {name: i for i, name in enumerate(symbol_names(num_symbols))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def pointer_docs(dm: Any, num_docs: int) -> list[dict[str, Any]]:
    """Documents of attnres_pointer for a SyntheticDataModule: one per query of each example, the
    context being the example's inputs up to that query's last ANS (as in training)."""
    S, P, H = dm.num_symbols, dm.num_pairs, dm.num_hops
    names = symbol_names(S)
    data = dm._dataset(TASK_STREAM, 0, 2**62)
    rng = np.random.default_rng(0)
    docs: list[dict[str, Any]] = []
    i = 0
    while len(docs) < num_docs:
        inputs, targets = (t.tolist() for t in data[i])
        i += 1
        follow = {inputs[2 * j + 1]: inputs[2 * j] - S for j in range(P)}  # key -> the symbol it points to
        for q in range(dm.num_queries):
            at = 2 * P + q * (1 + H)  # QUERY x_0 ANS * (H - 1)
            start = inputs[at + 1]
            chain = [start]
            for _ in range(H + 1):
                chain.append(follow[chain[-1]])
            picked = [chain[H], chain[H - 1], chain[H + 1]]  # the answer, one hop short, one too far
            picked = list(dict.fromkeys(picked))
            others = [s for s in rng.permutation(S).tolist() if s not in picked]
            picked += others[: 4 - len(picked)]
            order = rng.permutation(len(picked)).tolist()
            assert targets[at + H] == S + chain[H]
            docs.append({"context": " ".join(names[t] for t in inputs[: at + 1 + H]),
                         "choices": [f"v{picked[k]}" for k in order], "label": order.index(0)})
            if len(docs) == num_docs:
                break
    return docs


def next_line_docs(val: np.ndarray, block_size: int, num_docs: int) -> list[dict[str, Any]]:
    """Documents of attnres_next_line from held-out bytes: the text before a line (its last
    `block_size - MAX_LINE - 2` bytes, so that context and choice fit the model's window), and four
    choices: the line that follows and three others of the held-out text."""
    text = bytes(val[: 8 << 20]).decode("utf-8", errors="replace")
    lines = text.split("\n")
    starts = np.concatenate([[0], np.cumsum([len(line) + 1 for line in lines])])  # where line i starts in text
    budget = block_size - MAX_LINE - 2
    if budget < 16:
        raise ConfigError(f"attnres_next_line needs data.block_size >= {MAX_LINE + 18} (a line and its context); "
                          f"this run has {block_size}")
    pool = [i for i, line in enumerate(lines) if i >= 2 and 8 <= len(line.strip()) and len(line.encode()) <= MAX_LINE]
    distinct = sorted({lines[i] for i in pool})
    if len(distinct) < 4:
        raise ConfigError("attnres_next_line: the held-out text has fewer than 4 distinct lines to choose among; "
                          "use more text (data.val_fraction)")
    rng = np.random.default_rng(0)
    docs = []
    for i in sorted(rng.choice(pool, size=min(num_docs, len(pool)), replace=False).tolist()):
        context = text[max(0, int(starts[i]) - budget) : int(starts[i])]
        while len(context.encode()) > budget:  # characters of more than one byte
            context = context[1:]
        if not context.strip():  # lm-eval moves a context's trailing whitespace into the choices:
            continue  # one of whitespace alone would be left empty
        truth = lines[i]
        others: list[str] = []
        while len(others) < 3:
            pick = distinct[int(rng.integers(len(distinct)))]
            if pick != truth and pick not in others:
                others.append(pick)
        choices = [truth, *others]
        order = rng.permutation(4).tolist()
        docs.append({"context": context, "choices": [choices[k] + "\n" for k in order], "label": order.index(0)})
    return docs


def bpb_docs(val: np.ndarray, block_size: int, windows: int) -> list[dict[str, Any]]:
    """The one document of attnres_bpb: the bytes the runner's validation windows score (bytes 1 ..
    windows * block_size of the validation split), cut to whole UTF-8 characters."""
    windows = min(windows, (len(val) - 1) // block_size)
    data = bytes(val[1 : windows * block_size + 1])
    start, end = 0, len(data)
    while start < end and (data[start] & 0xC0) == 0x80:  # the rest of a character cut at the start
        start += 1
    for _ in range(4):  # a character cut at the end
        try:
            return [{"text": data[start:end].decode("utf-8")}]
        except UnicodeDecodeError:
            end -= 1
    return [{"text": data[start:end].decode("utf-8", errors="replace")}]


def task_docs(task: str, dm: Any, num_docs: int) -> tuple[list[dict[str, Any]], str]:
    """(the documents of one of attnres's tasks for the run's data module, what identifies them)."""
    if task == "attnres_pointer":
        if not hasattr(dm, "num_hops"):
            raise ConfigError("attnres_pointer needs a model trained on data=synthetic; attnres_next_line and "
                              "attnres_bpb suit byte-level runs")
        key = f"S{dm.num_symbols}-P{dm.num_pairs}-Q{dm.num_queries}-H{dm.num_hops}-T{dm.block_size}-n{num_docs}"
        return pointer_docs(dm, num_docs), key
    if not hasattr(dm, "memmaps"):
        raise ConfigError(f"{task} needs a byte-level run (data=stdlib or data=text); attnres_pointer suits "
                          "data=synthetic, and any lm-eval task by name suits a run with a text tokenizer")
    val = dm.memmaps()[1]
    ident = f"{dm.val_path.name}-T{dm.block_size}"
    if task == "attnres_next_line":
        return next_line_docs(val, dm.block_size, num_docs), f"{ident}-n{num_docs}"
    windows = dm.val_batches * dm.batch_size
    return bpb_docs(val, dm.block_size, windows), f"{ident}-w{windows}"


def write_task(task: str, docs: list[dict[str, Any]], key: str, root: Path | None = None) -> Path:
    """Write the documents and the task's YAML (absolute data path) into a folder of their own; returns
    the folder (an lm-eval include path). A folder already written for the same key is reused."""
    folder = (root or task_root()) / f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    data, spec = folder / "test.jsonl", folder / f"{task}.yaml"
    if data.is_file() and spec.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    atomic_write(data, lambda f: f.write(lines.encode("utf-8")))
    text = (YAML / f"{task}.yaml").read_text().replace("@DATA@", str(data.absolute()))
    atomic_write(spec, lambda f: f.write(text.encode("utf-8")))
    return folder


def prepare_own(tasks: list[str], dm: Any, num_docs: int) -> dict[str, Path]:
    """Each of attnres's tasks among `tasks`, written for the run's data module: {task: its folder}."""
    dm.setup() if hasattr(dm, "memmaps") else None
    return {task: write_task(task, *task_docs(task, dm, num_docs)) for task in tasks if task in OWN_TASKS}

"""What the tests of attnres.hf share: the six strategies' runs (trained once per test session,
`runs` in conftest.py) and the commands that made them."""

from __future__ import annotations

from pathlib import Path

from tests import helpers

STRATEGIES = ["standard", "block", "full", "denseformer", "hc", "mhc"]
PROMPT, NEW = "def", 24
DATA = ["data.max_files=20", "data.block_size=128"]  # room for docs/huggingface.md's generate.py
#: pseudo-queries at the model's learning rate, so that 10 steps move them well off zero
_RUN = helpers.tiny(*DATA, "num_blocks=2", "optim.query_lr_scale=1.0", "callbacks=none", data="stdlib",
                    steps=10, val_every=10, progress_bar=False)
RUNS = {name: [*_RUN, f"residual={name}"] for name in STRATEGIES}
SAMPLE = [*DATA, "data=stdlib", "trainer.accelerator=cpu", "mode=sample", "sample.temperature=0",
          f"sample.prompt={PROMPT}", f"sample.max_new_tokens={NEW}"]


def train_and_sample(root: Path) -> dict:
    trained = helpers.run_concurrently(root, RUNS)
    samples = {f"sample-{name}": [*SAMPLE, f"ckpt_path={root / name / 'checkpoints' / 'last.ckpt'}"]
               for name in STRATEGIES if trained[name]["returncode"] == 0}
    return {**trained, **helpers.run_concurrently(root, samples)}

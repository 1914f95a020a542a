"""What TensorBoard's HParams tab shows of a run (`tensorboard.HParamsSummary` writes it): each column's
value as the table prints it, the run's stage and trial name in its sweep, the columns its sweep varies,
and the plugin's protos.

A run knows its sweep only from the files beside its folder: the tuned sweeper's state (`run_stage`)
and the sweep's trial names (`attnres.results.summary.write_trial_names`), plus the keys the command
line swept (`attnres.config.naming.SWEPT_ENV`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def column_value(value: Any) -> Any:
    """What the HParams table shows: an integer as text (TensorBoard prints every number with four decimals:
    seed 1.0000, n_layer 8.0000), a missing value (num_blocks of a strategy without blocks) as "-"."""
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def run_stage(run_dir: Path) -> str:
    """"search" (a tuned sweep's trial, under <sweep>/tuning/), "shared lr" (a tuned sweep's run at the
    configured values, untuned=true), "verdict" (its run at an arm's choice), "run" (anything else)."""
    from attnres.results import tuning

    if run_dir.parent.name == tuning.TUNING_DIR and tuning.state_path(run_dir.parent.parent).is_file():
        return "search"
    if not tuning.state_path(run_dir.parent).is_file():
        return "run"
    state = tuning.read_state(run_dir.parent)
    untuned = {name for arm in state.get("arms", []) for name in (arm.get("untuned_jobs") or {}).values()}
    return "shared lr" if run_dir.name in untuned else "verdict"


def _sweep_names(run_dir: Path) -> dict[str, str]:
    """Its sweep's trial names (`attnres.results.summary.write_trial_names`), or none."""
    from attnres.atomic import read_json
    from attnres.results.summary import TRIAL_NAMES

    for base in (run_dir.parent, run_dir.parent.parent):  # a tuned sweep's trials: <sweep>/tuning/<run>
        names = read_json(base / TRIAL_NAMES)
        if isinstance(names, dict) and run_dir.relative_to(base).as_posix() in names:
            return {k: v for k, v in names.items() if isinstance(v, str)}
    return {}


def _keys(name: str) -> list[str]:
    from attnres.config.naming import split_overrides

    return [item.partition("=")[0] for item in split_overrides(name.rsplit(" (", 1)[0]) if "=" in item]


def sweep_varying(run_dir: Path, values: Mapping[str, Any], configured: Sequence[str]) -> list[str]:
    """The columns declared as differing: `configured`, then those its sweep varies (the keys its trial
    names hold, and the command line's, `attnres.config.naming.SWEPT_ENV`; a column is a key's last part:
    optim.optimizer.lr -> lr), and `stage` in a tuned sweep. Every run of a sweep declares the same."""
    import os

    from attnres.config.naming import SWEPT_ENV

    keys = {k for name in _sweep_names(run_dir).values() for k in _keys(name)}
    keys |= {k for k in os.environ.get(SWEPT_ENV, "").split(",") if k}
    swept = {k.rsplit(".", 1)[-1].lstrip("+~") for k in keys}
    varying = [*configured, *(c for c in values if c in swept and c not in configured)]
    return varying + (["stage"] if values.get("stage") not in (None, "run") else [])


def short_trial_name(run_dir: Path) -> str | None:
    """Its sweep's name for the run, short enough for the 18 characters TensorBoard's Trial ID column
    shows (it cut `optim.optimizer.lr=0.0015,residual=block,...` to `optim.optimizer....` for every
    trial): the strategy bare and first, then each key by its last part where that is unique,
    `block lr=0.0015 seed=1000 (quick)`."""
    from attnres.config.naming import split_overrides
    from attnres.results.summary import trial_name

    name = trial_name(run_dir)
    if not name:
        return None
    head, sep, sweep = name.partition(" (")
    items = [item.partition("=") for item in split_overrides(head)]
    lasts = [key.rsplit(".", 1)[-1] for key, _, _ in items]
    short = [value if key == "residual" else f"{last if lasts.count(last) == 1 else key}{eq}{value}"
             for (key, eq, value), last in zip(items, lasts, strict=True)]
    short.sort(key=lambda item: item not in [v for k, _, v in items if k == "residual"])  # the strategy first
    return " ".join(short) + sep + sweep


def hparams_summaries(values: Mapping[str, Any], metrics: Sequence[str], status: str = "STATUS_SUCCESS",
                      varying: Sequence[str] = (), trial: str | None = None) -> tuple:
    """(experiment, session start, session end) Summary protos of the HParams plugin; the
    hyperparameters named in `varying` are declared as differing across the runs. `trial` names
    the run in the HParams table (its session group; TensorBoard shows the run folder without it)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    def summary(tag: str, **content: Any) -> Summary:
        data = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
        plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString())
        return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])

    infos, start = [], plugin_data_pb2.SessionStartInfo(start_time_secs=time.time(), group_name=trial or "")
    for name, value in values.items():
        if isinstance(value, bool):
            kind = "DATA_TYPE_BOOL"
            start.hparams[name].bool_value = value
        elif isinstance(value, str):
            kind = "DATA_TYPE_STRING"
            start.hparams[name].string_value = value
        else:  # int, float, or None (declared numeric, left empty in this run)
            kind = "DATA_TYPE_FLOAT64"
            if value is not None:
                start.hparams[name].number_value = value
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind), differs=name in varying))
    experiment = api_pb2.Experiment(
        hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metrics]
    )
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(status), end_time_secs=time.time())
    return (summary(metadata.EXPERIMENT_TAG, experiment=experiment),
            summary(metadata.SESSION_START_INFO_TAG, session_start_info=start),
            summary(metadata.SESSION_END_INFO_TAG, session_end_info=end))

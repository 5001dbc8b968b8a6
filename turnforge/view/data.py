"""A run directory read for ``turnforge view``: what the page shows, as typed records and arrays.

``RunView(path)`` checks the directory (``locate_run``), opens its complete trajectory files as
a ``TrajectoryStore`` (DuckDB views over the Parquet files; nothing is written into the run) and
adds one table, ``episodes`` (``EPISODES``: one row per episode, light columns only, with
``ord``, its place in the run's order), then answers what the page asks:

- ``overview()``: config, ``summary.json``, status, counts, stages with their failures and
  truncations, rounds (the store's ``success_by_round``), sources (``success_by_source``), the
  records of ``metrics.jsonl`` as series (``page_series``: rounds and iterations numbered as the
  store numbers them, evaluations told apart by temperature and size), BC at each temperature,
  warnings;
- ``groups(BrowseQuery)``: a page of groups of the episodes that pass the filters;
- ``group(...)``, ``trajectory(...)``: episodes with their samples' recorded tokens (ids, loss
  mask, sampling logprobs, policy versions), the bytes of each token id (``TokenPieces``), judge
  verdicts and, for agent runs, the gateway's splits (``RUN/gateway_splits.jsonl``);
- ``same_task(task_id)``: the episodes of one task (two runs side by side);
- ``episode_columns()`` and ``token_arrays()``: everything at once, for the self-contained page.

A live run is read as it is (``turnforge.view.rundir``): a trajectory file still being written
is skipped and listed; ``refresh()`` picks up files written since. The records it returns are
``turnforge.view.records``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from turnforge.data.query import TrajectoryStore
from turnforge.data.store import SAMPLE_SPANS
from turnforge.errors import UserError
from turnforge.runs import RunDir
from turnforge.view.records import (BrowseQuery, Detail, GroupPage, Overview, SampleTokens, StageStats, Table,
                                    TokenArrays, Totals, TrajectoryDetail, json_value)
from turnforge.view.rundir import locate_run, page_series, read_config, read_json, read_series, stage_iterations
from turnforge.view.tokens import TokenPieces, find_tokenizer_dir

#: Stages in the order a run plays them (others follow, by name).
STAGE_ORDER: tuple[str, ...] = ("bc", "flywheel", "rl")

_STAGE_RANK = "CASE stage " + " ".join(f"WHEN '{s}' THEN {i}" for i, s in enumerate(STAGE_ORDER)) + f" ELSE {len(STAGE_ORDER)} END"

#: One row per episode, in run order (stage, iteration, group, episode; ids of one pattern in
#: natural order: 'rl-0-0-2' before 'rl-0-0-10'). Only light columns: the tokens stay in the files.
EPISODES = f"""
CREATE TEMP TABLE episodes AS
SELECT row_number() OVER (ORDER BY {_STAGE_RANK}, stage, iteration, len(group_id), group_id,
                                   len(trajectory_id), trajectory_id)::INTEGER - 1 AS ord, *
FROM (
    SELECT stage, iteration, source, trajectory_id, task_id, group_id, split_part(task_id, ':', 1) AS env,
           any_value(reward) AS reward, any_value(success) AS success, any_value(num_turns) AS num_turns,
           any_value(truncation_reason) AS truncation_reason, any_value(infra_failure) AS infra_failure,
           any_value(policy_version) AS policy_version, any_value(judge_score) AS judge_score,
           any_value(verifier_reward) AS verifier_reward, count(token_ids)::INTEGER AS n_samples
    FROM samples
    GROUP BY stage, iteration, source, trajectory_id, task_id, group_id
)
"""

#: The columns of ``episodes`` (the page's episode rows), in order.
EPISODE_COLUMNS: tuple[str, ...] = (
    "ord", "stage", "iteration", "source", "trajectory_id", "task_id", "group_id", "env", "reward", "success",
    "num_turns", "truncation_reason", "infra_failure", "policy_version", "judge_score", "verifier_reward", "n_samples",
)

_GROUPS = """
SELECT stage, iteration, group_id, min(task_id) AS task_id, min(env) AS env, count(*)::INTEGER AS n,
       (count(*) FILTER (WHERE success))::INTEGER AS successes,
       (count(*) FILTER (WHERE infra_failure IS NOT NULL))::INTEGER AS infra_failures,
       avg(reward) AS mean_reward, max(reward) AS best, min(reward) AS worst, min(ord) AS ord,
       list({{'trajectory_id': trajectory_id, 'reward': reward, 'success': success,
              'infra': infra_failure IS NOT NULL, 'truncated': truncation_reason}}
            ORDER BY reward DESC NULLS LAST, ord) AS members
FROM episodes WHERE {where}
GROUP BY stage, iteration, group_id
ORDER BY {order}
LIMIT {limit} OFFSET {offset}
"""
_ORDER = {"run": "ord", "spread": "best - worst DESC NULLS LAST, ord", "best": "best DESC NULLS LAST, ord",
          "worst": "worst ASC NULLS LAST, ord"}

_SEGMENT = ("coalesce(segment_index, 0) AS segment_index, coalesce(parent_segment, -1) AS parent_segment, "
            "coalesce(first_turn, 0) AS first_turn, coalesce(summary_tokens, 0) AS summary_tokens, "
            "coalesce(memory_start, 0) AS memory_start, coalesce(memory_tokens, 0) AS memory_tokens, "
            "coalesce(image_sha256, []::VARCHAR[]) AS image_sha256")
_SAMPLES = f"""
SELECT trajectory_id, turn_index, action_text, turn_reward, advantage, token_ids, logprobs, loss_mask, versions, {_SEGMENT}
FROM ({{src}}) WHERE token_ids IS NOT NULL AND stage = ? AND iteration = ? AND trajectory_id IN ({{ids}})
ORDER BY trajectory_id, turn_index, filename, file_row_number
"""
_EXTRA = """
SELECT trajectory_id, any_value(judge_prompt) AS judge_prompt, any_value(judge_output) AS judge_output,
       any_value(turn_advantages) AS turn_advantages, any_value(env_seed) AS env_seed
FROM ({src}) WHERE stage = ? AND iteration = ? AND trajectory_id IN ({ids})
GROUP BY trajectory_id
"""


# ---------------------------------------------------------------------- the run
class RunView:
    """One run directory opened for viewing (see the module docstring). Thread-safe: queries
    run one at a time."""

    def __init__(self, path: str | Path, index: int = 0) -> None:
        self.path = Path(path)
        self.run = RunDir(self.path)  # the layout its files are read from
        self.index = index
        self.files = locate_run(self.path)
        self.config_text, self.config = read_config(self.path)
        model_path = (self.config.get("model") or {}).get("path") if isinstance(self.config.get("model"), dict) else None
        tok_dir = find_tokenizer_dir(self.path, model_path)
        self.pieces = TokenPieces(tok_dir) if tok_dir is not None else None
        self._lock = threading.RLock()
        self._store: TrajectoryStore | None = None
        self._overview: Overview | None = None
        self._open()

    def _open(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store = TrajectoryStore(self.path, files=self.files.parquet)
        self._store.sql(EPISODES)
        self._keys = {f: stage_iterations(f) for f in self.files.parquet}
        self._overview = None

    def _files_of(self, stage: str, iteration: int) -> list[Path]:
        """The files that can hold rows of ``stage`` ``iteration``: by the footers' column
        statistics (a file without them is always included)."""
        return [f for f, keys in self._keys.items() if keys is None or (stage, iteration) in keys]

    def refresh(self) -> bool:
        """Read the run directory again (a live run writes new files); True when the files
        changed. A run whose files became unreadable keeps what it had."""
        with self._lock:
            files = locate_run(self.path)
            if files == self.files:
                return False
            self.files = files
            self._open()
            return True

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    def sql(self, query: str, params: list[Any] | None = None) -> pa.Table:
        with self._lock:
            assert self._store is not None, "closed"
            return self._store.sql(query, params)

    # ------------------------------------------------------------------ overview
    def overview(self) -> Overview:
        """The run's overview (cached until ``refresh`` finds new files)."""
        with self._lock:
            if self._overview is None:
                self._overview = self._make_overview()
            return self._overview

    def _make_overview(self) -> Overview:
        summary = read_json(self.run.summary)
        status = "finished" if summary is not None else "running" if self.files.live else "stopped"
        series, notes = read_series(self.run.metrics, self.files.live)
        series = page_series(series, self.config)
        t = self.sql("""
            SELECT count(*) AS episodes, count(*) FILTER (WHERE infra_failure IS NULL) AS scored,
                   count(*) FILTER (WHERE infra_failure IS NULL AND success) AS successes,
                   count(*) FILTER (WHERE infra_failure IS NOT NULL) AS infra_failures,
                   count(*) FILTER (WHERE truncation_reason IS NOT NULL) AS truncated,
                   coalesce(sum(n_samples), 0)::BIGINT AS samples,
                   count(DISTINCT (stage, iteration, group_id)) AS groups, count(DISTINCT task_id) AS tasks
            FROM episodes""").to_pylist()[0]
        rows = sum(pq.read_metadata(f).num_rows for f in self.files.parquet)
        totals = Totals(t["episodes"], t["scored"], t["successes"], t["infra_failures"], t["truncated"], t["samples"],
                        rows, self._token_count(rows - t["samples"]), t["groups"], t["tasks"])
        facets = {
            "stages": [r["stage"] for r in self.sql(f"SELECT DISTINCT stage FROM episodes ORDER BY {_STAGE_RANK}, stage").to_pylist()],
            "sources": self.sql("SELECT DISTINCT source FROM episodes ORDER BY source").column(0).to_pylist(),
            "envs": self.sql("SELECT DISTINCT env FROM episodes ORDER BY env").column(0).to_pylist(),
        }
        warnings = [row[series["warning"].columns.index("message")] for row in series["warning"].rows] if "warning" in series else []
        bc_temps = (summary or {}).get("eval_bc_best_temperature") or {}
        return Overview(
            index=self.index, name=self.path.resolve().name, path=str(self.path.resolve()), status=status,
            config=self.config, config_text=self.config_text, summary=summary,
            tokenizer=str(self.pieces.source) if self.pieces else None, files=[f.name for f in self.files.parquet],
            skipped=list(self.files.skipped), totals=totals, stages=self._stages(),
            rounds=Table.of(self.sql("SELECT * FROM success_by_round ORDER BY " + _STAGE_RANK + ", stage, iteration")),
            sources=Table.of(self.sql("SELECT * FROM success_by_source")), series=series, metrics_notes=notes,
            warnings=warnings,
            bc_temperatures=[{"temperature": e["temperature"], **e["result"]} for e in bc_temps.get("all", [])],
            gateway_splits=sum(len(v) for v in self.splits().values()), facets=facets,
        )

    def _stages(self) -> list[StageStats]:
        out = []
        for r in self.sql(f"""
                SELECT stage, count(*) AS episodes, sum(n_samples)::BIGINT AS samples,
                       count(*) FILTER (WHERE infra_failure IS NULL) AS scored,
                       count(*) FILTER (WHERE infra_failure IS NULL AND success) AS successes,
                       avg(reward) AS mean_reward, count(*) FILTER (WHERE infra_failure IS NOT NULL) AS infra_failures,
                       count(*) FILTER (WHERE truncation_reason IS NOT NULL) AS truncated,
                       list(DISTINCT iteration ORDER BY iteration) AS iterations
                FROM episodes GROUP BY stage ORDER BY {_STAGE_RANK}, stage""").to_pylist():
            reasons = self.sql("SELECT truncation_reason, count(*) AS n FROM episodes WHERE stage = ? AND truncation_reason IS NOT NULL "
                               "GROUP BY ALL ORDER BY n DESC, truncation_reason", [r["stage"]]).to_pylist()
            # the first line of each error with its numbers (task indices, seeds) as N: one row per kind of failure
            failures = self.sql("SELECT regexp_replace(split_part(infra_failure, chr(10), 1), '[0-9]+', 'N', 'g') AS why, "
                                "count(*) AS n FROM episodes "
                                "WHERE stage = ? AND infra_failure IS NOT NULL GROUP BY ALL ORDER BY n DESC, why LIMIT 10",
                                [r["stage"]]).to_pylist()
            out.append(StageStats(
                stage=r["stage"], episodes=r["episodes"], samples=r["samples"], scored=r["scored"],
                successes=r["successes"], success_rate=r["successes"] / r["scored"] if r["scored"] else None,
                mean_reward=json_value(r["mean_reward"]), infra_failures=r["infra_failures"], truncated=r["truncated"],
                truncations={x["truncation_reason"]: x["n"] for x in reasons},
                failures=[(x["why"][:300], x["n"]) for x in failures], iterations=r["iterations"]))
        return out

    def _token_count(self, null_lists: int) -> int:
        """Tokens in the files, from their footers (no token is read): the leaf values of
        ``token_ids`` less one per null list (an episode row)."""
        n = 0
        for f in self.files.parquet:
            meta = pq.read_metadata(f)
            col = next(i for i in range(meta.num_columns) if meta.schema.column(i).path.startswith("token_ids."))
            n += sum(meta.row_group(g).column(col).num_values for g in range(meta.num_row_groups))
        return n - null_lists

    # ------------------------------------------------------------------ browse
    def groups(self, q: BrowseQuery) -> GroupPage:
        """The groups of the episodes that pass ``q``'s filters, one page of them."""
        where, params = q.where()
        total = self.sql(f"SELECT count(*) AS e, count(DISTINCT (stage, iteration, group_id)) AS g FROM episodes WHERE {where}",
                         params).to_pylist()[0]
        rows = self.sql(_GROUPS.format(where=where, order=_ORDER[q.sort], limit=int(q.limit), offset=int(q.offset)), params)
        return GroupPage(total["g"], total["e"], q.offset, Table.of(rows))

    def episodes_where(self, where: str, params: list[Any], limit: int = 1000) -> list[dict[str, Any]]:
        rows = self.sql(f"SELECT * FROM episodes WHERE {where} ORDER BY reward DESC NULLS LAST, ord LIMIT {int(limit)}", params)
        return [{k: json_value(v) for k, v in r.items()} for r in rows.to_pylist()]

    def same_task(self, task_id: str, limit: int = 200) -> list[dict[str, Any]]:
        """Episodes of ``task_id`` (best reward first)."""
        return self.episodes_where("task_id = ?", [task_id], limit)

    def group(self, stage: str, iteration: int, group_id: str) -> Detail:
        """The G attempts of one group, best reward first, with their tokens."""
        eps = self.episodes_where("stage = ? AND iteration = ? AND group_id = ?", [stage, iteration, group_id])
        if not eps:
            raise UserError(f"no group {group_id!r} in stage {stage!r} iteration {iteration}")
        return self._detail(stage, iteration, eps)

    def trajectory(self, stage: str, iteration: int, trajectory_id: str) -> Detail:
        """One episode with its tokens."""
        eps = self.episodes_where("stage = ? AND iteration = ? AND trajectory_id = ?", [stage, iteration, trajectory_id])
        if not eps:
            raise UserError(f"no trajectory {trajectory_id!r} in stage {stage!r} iteration {iteration}")
        return self._detail(stage, iteration, eps)

    def _detail(self, stage: str, iteration: int, eps: list[dict[str, Any]]) -> Detail:
        ids = [e["trajectory_id"] for e in eps]
        marks = ", ".join("?" * len(ids))
        with self._lock:  # one iteration's files only: a run of many files answers as fast as a run of one
            assert self._store is not None, "closed"
            src = self._store.samples_of(self._files_of(stage, iteration), row_order=True)
        samples = self.sql(_SAMPLES.format(src=src, ids=marks), [stage, iteration, *ids]).to_pylist()
        extra = {r["trajectory_id"]: r for r in self.sql(_EXTRA.format(src=src, ids=marks), [stage, iteration, *ids]).to_pylist()}
        splits = self.splits()
        used: set[int] = set()
        out = []
        for e in eps:
            tid = e["trajectory_id"]
            mine = [s for s in samples if s["trajectory_id"] == tid]
            for s in mine:
                used.update(s["token_ids"])
            x = extra.get(tid, {})
            out.append(TrajectoryDetail(
                episode=e, judge_prompt=x.get("judge_prompt"), judge_output=x.get("judge_output"),
                turn_advantages=[json_value(a) for a in x["turn_advantages"]] if x.get("turn_advantages") else None,
                env_seed=x.get("env_seed"),
                samples=[SampleTokens(s["turn_index"], s["action_text"], json_value(s["turn_reward"]), json_value(s["advantage"]),
                                      s["token_ids"], [json_value(v, 5) for v in s["logprobs"]], s["loss_mask"], s["versions"],
                                      *(s[name] for name in SAMPLE_SPANS), images=s["image_sha256"])
                         for s in mine],
                splits=splits.get(tid, [])))
        return self._with_pieces(out, used)

    def _with_pieces(self, trajectories: list[TrajectoryDetail], used: set[int]) -> Detail:
        if self.pieces is None:
            return Detail(trajectories, {}, [])
        return Detail(trajectories, self.pieces.table(used), sorted(self.pieces.special & used))

    def image(self, sha: str) -> bytes | None:
        """The PNG bytes of image ``sha`` (a value of ``image_sha256``) from the run's
        ``trajectories/images/``; None when the run does not hold it."""
        from turnforge.data.store import IMAGES_DIR

        if not (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise UserError(f"image {sha!r}: expected a sha256 in hex (64 characters)")
        for folder in dict.fromkeys(f.parent / IMAGES_DIR for f in self.files.parquet):
            if (folder / f"{sha}.png").is_file():
                return (folder / f"{sha}.png").read_bytes()
        return None

    # ------------------------------------------------------------------ everything (file mode)
    def episode_columns(self) -> dict[str, list[Any]]:
        """Every episode row (``EPISODE_COLUMNS``) and its judge prompt and output, turn
        advantages and env seed, by column, in run order."""
        table = self.sql("""
            SELECT e.*, x.judge_prompt, x.judge_output, x.turn_advantages, x.env_seed FROM episodes e
            LEFT JOIN (SELECT stage, iteration, trajectory_id, any_value(judge_prompt) AS judge_prompt,
                              any_value(judge_output) AS judge_output, any_value(turn_advantages) AS turn_advantages,
                              any_value(env_seed) AS env_seed
                       FROM samples GROUP BY ALL) x USING (stage, iteration, trajectory_id)
            ORDER BY e.ord""")
        out = {}
        for name, col in zip(table.column_names, table.columns):
            values = col.to_pylist()
            out[name] = [[json_value(a) for a in v] if isinstance(v, list) else json_value(v) for v in values]
        return out

    def token_arrays(self) -> TokenArrays:
        """Every sample's tokens, in episode order, then turn order, then the order written."""
        with self._lock:
            assert self._store is not None, "closed"
            src = self._store.samples_of(self.files.parquet, row_order=True)
        t = self.sql(f"""
            SELECT e.ord, s.turn_index, s.action_text, s.turn_reward, s.advantage, s.token_ids, s.logprobs, s.loss_mask, s.versions,
                   {_SEGMENT}
            FROM ({src}) s JOIN episodes e USING (stage, iteration, source, trajectory_id, task_id, group_id)
            WHERE s.token_ids IS NOT NULL ORDER BY e.ord, s.turn_index, s.filename, s.file_row_number""")
        tokens = t.column("token_ids").combine_chunks()
        offsets = tokens.offsets.to_numpy().astype(np.int64)
        flat = lambda name, dtype, fill: t.column(name).combine_chunks().flatten().fill_null(fill).to_numpy(zero_copy_only=False).astype(dtype)  # noqa: E731
        return TokenArrays(
            episode=t.column("ord").to_numpy().astype(np.int32), turn_index=t.column("turn_index").to_numpy().astype(np.int32),
            action_text=t.column("action_text").to_pylist(),
            turn_reward=[json_value(v) for v in t.column("turn_reward").to_pylist()],
            advantage=[json_value(v) for v in t.column("advantage").to_pylist()],
            start=offsets[:-1] - offsets[0], length=np.diff(offsets).astype(np.int32),
            ids=tokens.flatten().to_numpy().astype(np.int32), logprobs=flat("logprobs", np.float32, float("nan")),
            mask=flat("loss_mask", np.int8, 0), versions=flat("versions", np.int32, -1),
            **{name: t.column(name).to_numpy().astype(np.int32)
               for name in SAMPLE_SPANS}, images=t.column("image_sha256").to_pylist())

    def splits(self) -> dict[str, list[dict[str, Any]]]:
        """``RUN/gateway_splits.jsonl`` by rollout (trajectory id); a line that does not parse
        (being written) is left out."""
        path = self.run.gateway_splits
        out: dict[str, list[dict[str, Any]]] = {}
        if not path.is_file():
            return out
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "rollout" in row:
                out.setdefault(str(row["rollout"]), []).append(row)
        return out

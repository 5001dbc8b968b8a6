"use strict";
// turnforge view: the page of one run (or two side by side). Its data comes from a FileSource
// (embedded in this file: `turnforge view RUN`) or a ServerSource (`turnforge view RUN --serve`,
// JSON from the local server, paged through DuckDB); every view calls the same async methods on
// either. Tokens are the recorded ids, shown as the bytes the run's tokenizer gives each id,
// decoded as one UTF-8 stream: never re-templated, never re-tokenized.

const BOOT = JSON.parse(document.getElementById("tf-boot").textContent);
const RUN_COLORS = ["#2f6fdf", "#d9480f"];
const EPISODE_COLUMNS = ["ord", "stage", "iteration", "source", "trajectory_id", "task_id", "group_id", "env", "reward",
  "success", "num_turns", "truncation_reason", "infra_failure", "policy_version", "judge_score", "verifier_reward", "n_samples"];
const GROUP_COLUMNS = ["stage", "iteration", "group_id", "task_id", "env", "n", "successes", "infra_failures",
  "mean_reward", "best", "worst", "ord", "members"];
// metrics.jsonl records that name a set of stored episodes; their iterations and rounds come
// numbered as the store numbers them, from 0 (turnforge.view.rundir.page_series)
const CURVE_LINKS = {
  rl_iter: (row) => ({ stage: "rl", iteration: row.iteration }),
  flywheel_round: (row) => ({ stage: "flywheel", iteration: row.round }),
  bc_epoch: () => ({ stage: "bc" }),
};

// ---------------------------------------------------------------- small helpers
const $ = (sel, root = document) => root.querySelector(sel);
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k === "html") node.innerHTML = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false) node.append(c instanceof Node ? c : String(c));
  return node;
}
const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
function num(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toFixed(digits).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
}
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
const rowsOf = (t) => t.rows.map((r) => Object.fromEntries(t.columns.map((c, j) => [c, r[j]])));
const nullsLast = (a, b, dir) => (a == null ? (b == null ? 0 : 1) : b == null ? -1 : dir * (a - b));
function hashOf(name, params = {}) {
  const qs = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "")).toString();
  return "#" + name + (qs ? "?" + qs : "");
}
function parseHash() {
  const [name, qs] = location.hash.slice(1).split("?");
  return { name: name || "overview", params: Object.fromEntries(new URLSearchParams(qs || "")) };
}

// ---------------------------------------------------------------- token bytes
class Vocab {
  // id -> bytes (from hex), and the ids the tokenizer flags special
  constructor() { this.hex = new Map(); this.cache = new Map(); this.special = new Set(); this.none = false; }
  add(pieces, special) {
    for (const [id, hx] of Object.entries(pieces || {})) this.hex.set(+id, hx);
    for (const id of special || []) this.special.add(id);
  }
  bytes(id) {
    let b = this.cache.get(id);
    if (b === undefined) {
      const hx = this.hex.get(id);
      if (hx === undefined) return null;
      b = new Uint8Array(hx.length / 2);
      for (let i = 0; i < b.length; i++) b[i] = parseInt(hx.substr(2 * i, 2), 16);
      this.cache.set(id, b);
    }
    return b;
  }
}
const UTF8 = new TextDecoder("utf-8");
function tokenTexts(ids, vocab) {
  // each token's text, the sample decoded as one UTF-8 stream: a character split across tokens
  // shows on the token that completes it (the others show as partial)
  const dec = new TextDecoder("utf-8");
  const out = new Array(ids.length);
  for (let k = 0; k < ids.length; k++) {
    const id = ids[k];
    const b = vocab.bytes(id);
    if (b === null) { out[k] = { text: "⟨" + id + "⟩", unknown: true }; continue; }
    if (vocab.special.has(id)) {
      const pending = dec.decode();
      if (pending && k > 0) out[k - 1].text += pending;
      out[k] = { text: UTF8.decode(b), special: true };
      continue;
    }
    out[k] = { text: dec.decode(b, { stream: true }) };
  }
  const tail = dec.decode();
  if (tail && ids.length) out[ids.length - 1].text += tail;
  return out;
}
function visible(html) {
  // line breaks and tabs marked, other control characters as their Unicode control pictures
  return html.replace(/\n/g, '<span class="nl">↵</span>\n').replace(/\t/g, '<span class="nl">→</span>\t')
    .replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g, (c) => `<span class="nl">${c === "\u007f" ? "␡" : String.fromCharCode(0x2400 + c.charCodeAt(0))}</span>`);
}
const oneLine = (text) => text.replace(/\n/g, "↵").replace(/[\u0000-\u0008\u000b-\u001f]/g, (c) => String.fromCharCode(0x2400 + c.charCodeAt(0)));
function actionRuns(sample, texts) {
  // the maximal runs of trained tokens (loss mask 1): one per turn or model call
  const runs = [];
  let cur = null;
  for (let k = 0; k < sample.ids.length; k++) {
    if (sample.mask[k]) { if (!cur) { cur = { start: k, text: "" }; runs.push(cur); } cur.text += texts[k].text; }
    else cur = null;
  }
  return runs;
}

// ---------------------------------------------------------------- data sources
async function unpack(id) {
  // base64 of gzip bytes in a <script> element -> bytes (decoded by the browser, no library)
  const b64 = document.getElementById(id).textContent.trim();
  const packed = await (await fetch("data:application/octet-stream;base64," + b64)).blob();
  return new Response(packed.stream().pipeThrough(new DecompressionStream("gzip"))).arrayBuffer();
}

class FileSource {
  static async load(n) {
    const runs = [];
    for (let i = 0; i < n; i++) {
      const d = JSON.parse(UTF8.decode(await unpack(`tf-run-${i}`)));
      d.ids = new Int32Array(await unpack(`tf-blob-${i}-ids`));
      d.logprobs = new Float32Array(await unpack(`tf-blob-${i}-logprobs`));
      d.mask = new Int8Array(await unpack(`tf-blob-${i}-mask`));
      d.versions = new Int32Array(await unpack(`tf-blob-${i}-versions`));
      const E = d.episodes.ord.length;
      d.first = new Int32Array(E).fill(-1);
      d.count = new Int32Array(E);
      d.samples.episode.forEach((e, s) => { if (d.first[e] < 0) d.first[e] = s; d.count[e]++; });
      d.vocab = new Vocab();
      d.vocab.add(d.pieces, d.special);
      d.vocab.none = d.overview.tokenizer === null;
      runs.push(d);
    }
    return new FileSource(runs);
  }
  constructor(runs) { this.runs = runs; this.live = false; }
  vocab(run) { return this.runs[run].vocab; }
  async overviews() { return this.runs.map((r) => r.overview); }
  row(r, i) { const o = {}; for (const c of EPISODE_COLUMNS) o[c] = r.episodes[c][i]; return o; }
  match(r, i, q) {
    const E = r.episodes;
    if (q.stage && E.stage[i] !== q.stage) return false;
    if (q.iteration !== undefined && q.iteration !== "" && E.iteration[i] !== +q.iteration) return false;
    if (q.source && E.source[i] !== q.source) return false;
    if (q.env && E.env[i] !== q.env) return false;
    if (q.task && !E.task_id[i].includes(q.task)) return false;
    if (q.task_id && E.task_id[i] !== q.task_id) return false;
    if (q.outcome === "success" && E.success[i] !== true) return false;
    if (q.outcome === "failure" && !(E.infra_failure[i] === null && E.success[i] === false)) return false;
    if (q.outcome === "infra" && E.infra_failure[i] === null) return false;
    if (q.outcome === "truncated" && E.truncation_reason[i] === null) return false;
    const rw = E.reward[i];
    if (q.reward_min !== undefined && q.reward_min !== "" && (rw === null || rw < +q.reward_min)) return false;
    if (q.reward_max !== undefined && q.reward_max !== "" && (rw === null || rw > +q.reward_max)) return false;
    return true;
  }
  async groups(run, q) {
    // the same groups, order and page as RunView.groups (turnforge/view/data.py) computes in SQL
    const r = this.runs[run], E = r.episodes;
    const byKey = new Map();
    let matched = 0;
    for (let i = 0; i < E.ord.length; i++) {
      if (!this.match(r, i, q)) continue;
      matched++;
      const key = E.stage[i] + "\u0001" + E.iteration[i] + "\u0001" + E.group_id[i];
      let g = byKey.get(key);
      if (!g) byKey.set(key, (g = []));
      g.push(i);
    }
    const rows = [...byKey.values()].map((idx) => {
      const rewards = idx.map((i) => E.reward[i]).filter((v) => v !== null);
      const members = idx.map((i) => ({ trajectory_id: E.trajectory_id[i], reward: E.reward[i], success: E.success[i],
        infra: E.infra_failure[i] !== null, truncated: E.truncation_reason[i], ord: i }));
      members.sort((a, b) => nullsLast(a.reward, b.reward, -1) || a.ord - b.ord);
      const i0 = idx[0];
      return { stage: E.stage[i0], iteration: E.iteration[i0], group_id: E.group_id[i0],
        task_id: idx.map((i) => E.task_id[i]).sort()[0], env: idx.map((i) => E.env[i]).sort()[0], n: idx.length,
        successes: idx.filter((i) => E.success[i] === true).length,
        infra_failures: idx.filter((i) => E.infra_failure[i] !== null).length,
        mean_reward: rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null,
        best: rewards.length ? Math.max(...rewards) : null, worst: rewards.length ? Math.min(...rewards) : null,
        ord: i0, members: members.map(({ ord, ...m }) => m) };
    });
    const sort = q.sort || "run";
    const spread = (g) => (g.best === null ? null : g.best - g.worst);
    const cmp = { run: (a, b) => a.ord - b.ord, spread: (a, b) => nullsLast(spread(a), spread(b), -1) || a.ord - b.ord,
      best: (a, b) => nullsLast(a.best, b.best, -1) || a.ord - b.ord, worst: (a, b) => nullsLast(a.worst, b.worst, 1) || a.ord - b.ord }[sort];
    rows.sort(cmp);
    const offset = +(q.offset || 0), limit = +(q.limit || 50);
    return { total_groups: rows.length, total_episodes: matched, offset,
      rows: { columns: GROUP_COLUMNS, rows: rows.slice(offset, offset + limit).map((g) => GROUP_COLUMNS.map((c) => g[c])) } };
  }
  detail(r, idx) {
    const E = r.episodes;
    return { pieces: {}, special: [], trajectories: idx.map((i) => {
      const samples = [];
      for (let s = r.first[i]; s >= 0 && s < r.first[i] + r.count[i]; s++) {
        const a = r.samples.start[s], b = a + r.samples.length[s];
        samples.push({ turn_index: r.samples.turn_index[s], action_text: r.samples.action_text[s],
          turn_reward: r.samples.turn_reward[s], advantage: r.samples.advantage[s], ids: r.ids.subarray(a, b),
          logprobs: r.logprobs.subarray(a, b), mask: r.mask.subarray(a, b), versions: r.versions.subarray(a, b),
          segment_index: r.samples.segment_index[s], parent_segment: r.samples.parent_segment[s],
          first_turn: r.samples.first_turn[s], summary_tokens: r.samples.summary_tokens[s],
          memory_start: r.samples.memory_start[s], memory_tokens: r.samples.memory_tokens[s],
          images: (r.samples.images || [])[s] || [] });
      }
      return { episode: this.row(r, i), judge_prompt: E.judge_prompt[i], judge_output: E.judge_output[i],
        turn_advantages: E.turn_advantages[i], env_seed: E.env_seed[i], samples, splits: r.splits[E.trajectory_id[i]] || [] };
    }) };
  }
  find(r, pred) { const E = r.episodes, out = []; for (let i = 0; i < E.ord.length; i++) if (pred(E, i)) out.push(i); return out; }
  // a sample's image: embedded in the page (up to its image budget), else null (shown as its hash)
  imageUrl(run, sha) { const b = (this.runs[run].image_data || {})[sha]; return b ? "data:image/png;base64," + b : null; }
  byReward(r, idx) { const E = r.episodes; return idx.sort((a, b) => nullsLast(E.reward[a], E.reward[b], -1) || a - b); }
  async group(run, stage, iteration, gid) {
    const r = this.runs[run];
    const idx = this.find(r, (E, i) => E.stage[i] === stage && E.iteration[i] === +iteration && E.group_id[i] === gid);
    if (!idx.length) throw new Error(`no group ${gid} in stage ${stage} iteration ${iteration}`);
    return this.detail(r, this.byReward(r, idx));
  }
  async trajectory(run, stage, iteration, tid) {
    const r = this.runs[run];
    const idx = this.find(r, (E, i) => E.stage[i] === stage && E.iteration[i] === +iteration && E.trajectory_id[i] === tid);
    if (!idx.length) throw new Error(`no trajectory ${tid} in stage ${stage} iteration ${iteration}`);
    return this.detail(r, idx);
  }
  async sameTask(run, task) {
    const r = this.runs[run];
    return this.byReward(r, this.find(r, (E, i) => E.task_id[i] === task)).slice(0, 200).map((i) => this.row(r, i));
  }
}

class ServerSource {
  constructor(n) { this.vocabs = Array.from({ length: n }, () => new Vocab()); this.live = true; }
  vocab(run) { return this.vocabs[run]; }
  async get(path, params = {}) {
    const qs = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== ""));
    const res = await fetch(`api/${path}?${qs}`);
    const body = await res.json();
    if (!res.ok) throw new Error(body.error || res.statusText);
    return body;
  }
  async overviews() {
    const runs = await this.get("overview");
    runs.forEach((o, i) => { this.vocabs[i].none = o.tokenizer === null; });
    return runs;
  }
  async groups(run, q) { return this.get("groups", { ...q, run }); }
  async withPieces(run, detail) { this.vocabs[run].add(detail.pieces, detail.special); return detail; }
  async group(run, stage, iteration, group) { return this.withPieces(run, await this.get("group", { run, stage, iteration, group })); }
  async trajectory(run, stage, iteration, id) { return this.withPieces(run, await this.get("trajectory", { run, stage, iteration, id })); }
  async sameTask(run, task) { return this.get("same_task", { run, task }); }
  imageUrl(run, sha) { return `api/image?${new URLSearchParams({ run, sha })}`; }
}

// ---------------------------------------------------------------- app state and routing
const state = { src: null, overviews: null };
const app = () => $("#app");
async function overviews(force = false) {
  if (!state.overviews || force) state.overviews = await state.src.overviews();
  return state.overviews;
}
function runName(i) { return state.overviews && state.overviews[i] ? state.overviews[i].name : `run ${i}`; }
function runTag(i) {
  return el("span", { class: "runtag", style: `color:${RUN_COLORS[i]};font-weight:600` }, runName(i));
}

async function route() {
  const { name, params } = parseHash();
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === name ||
    (a.dataset.nav === "browse" && (name === "group" || name === "traj"))));
  const t0 = performance.now();
  try {
    const views = { overview: viewOverview, browse: viewBrowse, group: viewGroup, traj: viewTrajectory };
    const view = views[name] || viewOverview;
    if (name === "overview" && state.src.live) await overviews(true);
    else await overviews();
    renderLegend();
    const node = await view(params);
    app().replaceChildren(node);
    window.scrollTo(0, 0);
  } catch (err) {
    app().replaceChildren(el("div", { class: "error", "data-testid": "error" }, String(err && err.message ? err.message : err)));
  }
  // for tests and benchmarks: which view is drawn, how long it took, when (ms from navigation start)
  document.body.dataset.renderMs = String(Math.round(performance.now() - t0));
  document.body.dataset.readyAt = String(Math.round(performance.now()));
  document.body.dataset.ready = name;
}

function renderLegend() {
  const legend = $("#runs-legend");
  legend.replaceChildren(...state.overviews.map((o, i) => el("span", {},
    el("span", { class: "swatch", style: `background:${RUN_COLORS[i]}` }), `${o.name}`)));
  const live = state.src.live ? "served from the run directory (read-only) · " : "self-contained page · ";
  $("#status").replaceChildren(live, el("a", { href: "#", onclick: (e) => { e.preventDefault(); state.overviews = null; route(); } }, "reload"));
}

// ---------------------------------------------------------------- overview
function card(k, v, testid, sub) {
  return el("div", { class: "card" }, el("div", { class: "k" }, k),
    el("div", { class: "v", "data-testid": testid }, v, sub ? el("small", {}, " " + sub) : null));
}
function table(columns, rows, opts = {}) {
  const t = el("table", { class: "t" + (opts.cls ? " " + opts.cls : "") });
  t.append(el("thead", {}, el("tr", {}, columns.map((c) => el("th", { class: c.n ? "n" : "" }, c.label)))));
  const body = el("tbody");
  for (const r of rows) {
    const tr = el("tr", { class: opts.onclick ? "click" : "" , ...(opts.attrs ? opts.attrs(r) : {}) },
      columns.map((c) => { const v = c.get(r); return el("td", { class: c.n ? "n" : "" }, v instanceof Node ? v : v ?? "–"); }));
    if (opts.onclick) tr.addEventListener("click", (e) => { if (!e.target.closest("a")) opts.onclick(r); });
    body.append(tr);
  }
  t.append(body);
  return t;
}
function boundaryReports(summary) {
  // summary.json's reports of what the policy can solve (BoundaryReport: boundary_start,
  // boundary_after; any object with a pass_at_k), each with its pass@k as [k, value] pairs (from a
  // list of {k, value} or a {k: value} map), k ascending
  const out = [];
  const visit = (obj, path) => {
    for (const [key, v] of Object.entries(obj || {})) {
      if (!v || typeof v !== "object" || Array.isArray(v)) continue;
      if (!v.pass_at_k) { visit(v, path + key + "."); continue; }
      const pairs = Array.isArray(v.pass_at_k) ? v.pass_at_k.map((p) => [p && p.k, p && p.value]) : Object.entries(v.pass_at_k).map(([k, x]) => [+k, x]);
      const name = path + key;
      out.push({ name, label: { start: "at the start", after: "after training" }[v.tag] || name, report: v,
        points: pairs.filter(([k, x]) => typeof k === "number" && k > 0 && typeof x === "number").sort((a, b) => a[0] - b[0]) });
    }
  };
  visit(summary, "");
  return out;
}

function boundaryPanel(o) {
  // pass@k against k, the start against the end, and the report's figures (BoundaryReport's fields)
  const reports = boundaryReports(o.summary);
  const ks = [...new Set(reports.flatMap((r) => r.points.map(([k]) => k)))].sort((a, b) => a - b);
  const series = reports.map((r, i) => ({ label: r.label, run: o.index, main: i === reports.length - 1,
    color: i === reports.length - 1 ? RUN_COLORS[o.index] : SERIES_COLORS[i % SERIES_COLORS.length],
    mark: i === reports.length - 1 ? "circle" : MARKS[1 + (i % (MARKS.length - 1))],
    points: r.points.map(([k, v]) => ({ x: Math.log2(k), y: v, title: `${o.name} · ${r.label} · pass@${k} ${num(v, 4)}` })) }));
  const box = el("div", { class: "chart", "data-kind": "pass_at_k", "data-run": o.index },
    el("div", { class: "head" }, el("span", {}, "pass@k: the share of tasks solved in k samples")));
  const plot = el("div", { class: "plot" });
  box.append(plot, seriesLegend(series) || "", el("div", { class: "hint" }, "k (log scale)"));
  drawSeries(plot, series, { yRange: [0, 1], xTicks: ks.map((k) => [Math.log2(k), k]) });
  // the figures, one row each, one column per report
  const never = [...new Set(reports.flatMap((r) => Object.keys(r.report).filter((k) => /^never_solved/.test(k) && typeof r.report[k] === "number")))];
  const temp = (t) => (t != null ? ` at T=${t}` : "");
  // pass@1 and pass@k at the largest k first: sharpening raises the one, expansion the other; then the
  // levels (tasks) solved at the end but not at the start and the reverse, where both reports list them
  const kMax = ks[ks.length - 1];
  const passAt = (k) => ({ key: `pass_at_${k}`, label: `pass@${k}`, value: (x) => x.points.find(([j]) => j === k)?.[1], text: (v) => num(v, 3) });
  const start = reports.find((r) => r.report.tag === "start");
  const solved = (r) => (Array.isArray(r.report.solved) && r.report.solved.length ? new Set(r.report.solved) : null);
  const gainedLost = { key: "gained_lost", label: "tasks solved, gained / lost against the start",
    value: (x) => { const a = start && x !== start && solved(start), b = solved(x);
      return a && b ? [[...b].filter((t) => !a.has(t)).length, [...a].filter((t) => !b.has(t)).length] : undefined; },
    text: ([g, l]) => `${g} / ${l}` };
  const figures = [
    ...(ks.includes(1) ? [passAt(1)] : []), ...(kMax > 1 ? [passAt(kMax)] : []), gainedLost,
    { key: "tasks", label: "tasks × samples", text: (x) => `${num(x.tasks)} × ${num(x.samples_per_task)}${temp(x.temperature)}` },
    ...never.map((key) => ({ key, label: key === "never_solved_share" ? "never solved" : `never solved in ${key.replace(/^never_solved_(at_)?/, "")} samples`,
      text: (x) => pct(x[key]) })),
    { key: "solved_tasks", label: "tasks solved", text: (x) => `${num(x.solved_tasks)} / ${num(x.tasks)}` },
    { key: "distinct_successes", label: "distinct successes per solved task", text: (x) => num(x.distinct_successes, 2) },
    { key: "entropy", label: "entropy on action tokens (nats)", text: (x) => num(x.entropy) },
    { key: "malformed_rate", label: "malformed actions in the samples", text: (x) => pct(x.malformed_rate) },
    { key: "eval_malformed_rate", label: "malformed actions in the evaluation", text: (x) => `${pct(x.eval_malformed_rate)}${temp(x.eval_temperature)}` },
    { key: "infra_failures", label: "samples lost to infrastructure failures", text: (x) => num(x.infra_failures) },
  ];
  // a figure's value in one report: its own function, else the report's number under its key
  const valueOf = (f, r) => (f.value ? f.value(r) : typeof r.report[f.key] === "number" ? r.report : undefined);
  const shown = figures.filter((f) => reports.some((r) => valueOf(f, r) != null));
  const columns = [{ label: "", get: (f) => f.label }, ...reports.map((r) => ({ label: r.label, n: 1,
    get: (f) => { const v = valueOf(f, r); return v != null ? el("span", { "data-key": `${r.name}.${f.key}` }, f.text(v)) : "–"; } }))];
  return el("div", { class: "boundary" }, box, table(columns, shown, { cls: "boundary-figures" }));
}

// where the run's figures repeat bit for bit: the CPU, torch's kernel path, threads, versions (summary.json's software)
function machineLine(s) {
  const w = s && s.software;
  if (!w) return null;
  const cpu = [w.cpu_model, w.cpu_vendor && `${w.cpu_vendor}${w.cpu_family_model ? ` family/model ${w.cpu_family_model}` : ""}`].filter(Boolean).join(", ");
  const pins = Object.entries(w.kernel_env || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  return el("div", { class: "muted small", "data-testid": "machine" },
    `CPU ${cpu || "?"}${(w.cpu_flags || []).length ? ` (${w.cpu_flags.join(" ")})` : ""} · kernels ${w.cpu_capability}` +
    `${w.threads ? ` · ${w.threads} thread${w.threads > 1 ? "s" : ""}` : ""} · torch ${w.torch}${w.mkl ? ` · MKL ${w.mkl}` : ""}` +
    `${pins ? ` · ${pins}` : ""}`);
}

function runPanel(o) {
  const s = o.summary, T = o.totals, cfg = o.config || {};
  const head = el("div", { class: "runhead" }, el("span", { class: "name", style: `color:${RUN_COLORS[o.index]}` }, o.name),
    el("span", { class: `badge ${o.status}`, "data-testid": "status" }, o.status), el("span", { class: "muted small" }, o.path));
  const model = cfg.model ? (cfg.model.gguf ? `gguf:${cfg.model.gguf}` : cfg.model.path) : "?";
  const facts = el("div", { class: "muted small" }, `recipe ${cfg.recipe ?? "?"} · env ${cfg.env ? cfg.env.id : "?"} · model ${model} · seed ${cfg.seed ?? "?"} · `,
    o.tokenizer ? `tokens decoded with ${o.tokenizer}` : "no tokenizer in the run directory: tokens shown as ids");
  const cards = el("div", { class: "cards" },
    card("episodes", num(T.episodes), "total-episodes", `${num(T.groups)} groups`),
    card("samples", num(T.samples), "total-samples", `${num(T.tokens)} tokens`),
    card("infra failures", num(T.infra_failures), "total-failures", T.episodes ? pct(T.infra_failures / T.episodes) : ""),
    card("truncated", num(T.truncated), "total-truncated"),
    card("success (scored)", T.scored ? pct(T.successes / T.scored) : "–", "total-success", `${num(T.successes)} / ${num(T.scored)}`));
  const panel = el("div", { class: "panel", "data-run": o.index }, head, facts, machineLine(s), el("div", { style: "height:8px" }), cards);
  if (s) {
    const b = s.eval_before_rl, a = s.eval_after_rl, best = s.eval_bc_best_temperature;
    const line = el("div", { class: "cards", style: "margin-top:10px" },
      card("held-out success after BC", pct(b.success_rate), "summary-before", `${b.episodes} episodes`),
      card("at the end", pct(a.success_rate), "summary-after", `${s.success_gain_points >= 0 ? "+" : ""}${num(s.success_gain_points, 1)} points`),
      best ? card(`BC at its best T=${best.temperature}`, pct(best.eval.success_rate), "summary-bc-best",
        s.gain_over_bc_best_points != null ? `${s.gain_over_bc_best_points >= 0 ? "+" : ""}${num(s.gain_over_bc_best_points, 1)} points over it` : "") : null,
      card("wall time", `${num(s.wall_seconds / 60, 1)} min`, "summary-wall", `${num(s.env_steps)} env steps`));
    panel.append(line);
  }
  for (const f of o.skipped) panel.append(el("div", { class: "note" }, `${f.name} left out: ${f.why}`));
  for (const n of o.metrics_notes) panel.append(el("div", { class: "note" }, n));
  return panel;
}

function stagesTable(o) {
  return table([
    { label: "stage", get: (r) => el("a", { href: hashOf("browse", { run: o.index, stage: r.stage }) }, r.stage) },
    { label: "episodes", n: 1, get: (r) => num(r.episodes) }, { label: "samples", n: 1, get: (r) => num(r.samples) },
    { label: "success", n: 1, get: (r) => pct(r.success_rate) }, { label: "mean reward", n: 1, get: (r) => num(r.mean_reward) },
    { label: "infra failures", n: 1, get: (r) => r.infra_failures ? el("a", { href: hashOf("browse", { run: o.index, stage: r.stage, outcome: "infra" }) }, num(r.infra_failures)) : "0" },
    { label: "truncated", n: 1, get: (r) => r.truncated ? el("a", { href: hashOf("browse", { run: o.index, stage: r.stage, outcome: "truncated" }) }, num(r.truncated)) : "0" },
    { label: "truncations by reason", get: (r) => Object.entries(r.truncations).map(([k, v]) => `${k}: ${v}`).join(", ") || "–" },
    { label: "failures (first line of the error)", get: (r) => r.failures.length ? el("div", { class: "small" }, r.failures.map(([w, n]) => el("div", {}, `${n} × ${w}`))) : "–" },
  ], o.stages, { cls: "stages", attrs: (r) => ({ "data-stage": r.stage }) });
}

function roundsTable(o) {
  const rows = rowsOf(o.rounds);
  return table([
    { label: "stage", get: (r) => r.stage }, { label: "iteration", n: 1, get: (r) => r.iteration },
    { label: "episodes", n: 1, get: (r) => num(r.episodes) }, { label: "scored", n: 1, get: (r) => num(r.scored) },
    { label: "success", n: 1, get: (r) => pct(r.success_rate) }, { label: "mean reward", n: 1, get: (r) => num(r.mean_reward) },
    { label: "infra failures", n: 1, get: (r) => num(r.infra_failures) },
  ], rows, { onclick: (r) => { location.hash = hashOf("browse", { run: o.index, stage: r.stage, iteration: r.iteration }); } });
}

function mechanismColumns(o) {
  // one column per flywheel mechanism of the run (FlywheelRound.mechanisms.NAME: its episodes and
  // successes, then what else its record holds); runs written before the records were per mechanism
  // have their episode counts at the top (guided.0, ...)
  const s = o.series.flywheel_round, cols = s ? s.columns : [];
  const names = [...new Set(cols.map((c) => (c.match(/^mechanisms\.([^.]+)\./) || [])[1]).filter(Boolean))];
  const cell = (r, p) => {
    const rest = Object.keys(r).filter((k) => k.startsWith(p) && !k.startsWith(p + "episodes") && r[k] != null);
    return [r[p + "episodes.0"] == null ? "" : `${r[p + "episodes.0"]} / ${r[p + "episodes.1"]}`,
      rest.length ? `(${rest.map((k) => `${k.slice(p.length)} ${num(r[k])}`).join(", ")})` : ""].filter(Boolean).join(" ");
  };
  const old = ["retry", "guided", "curriculum", "evolved", "anchor"].filter((k) => !names.length && cols.includes(k + ".0"));
  return [...names.map((name) => ({ label: name, n: 1, get: (r) => cell(r, `mechanisms.${name}.`) })),
    ...old.map((k) => ({ label: k, n: 1, get: (r) => `${r[k + ".0"]} / ${r[k + ".1"]}` }))];
}

function seriesRows(o, kind) {
  const s = o.series[kind];
  return s ? rowsOf(s) : [];
}

// record fields that a run holds a real value in only with an option on: where the option is off,
// the records say 0 (flywheel.pass_k == 1 drops nothing), and that 0 is no measurement to draw
const OPTION_FIELDS = {
  "flywheel_round.pass_k_dropped": (cfg) => ((cfg.flywheel || {}).pass_k ?? 1) >= 2,
};

function recorded(o, kind, col) {
  // whether run o recorded column col of its kind's records: a number in some record, and for a
  // field of an option (OPTION_FIELDS) the option on, or a value other than 0 in some record
  const s = o.series[kind], j = s ? s.columns.indexOf(col) : -1;
  const values = j < 0 ? [] : s.rows.map((r) => r[j]).filter((v) => typeof v === "number");
  const option = OPTION_FIELDS[`${kind}.${col}`];
  return values.length > 0 && (!option || option(o.config || {}) || values.some((v) => v !== 0));
}

function chartSpecs(os) {
  const has = (kind, col) => os.some((o) => recorded(o, kind, col));
  const specs = [
    { kind: "eval", x: "env_steps", y: "result.success_rate", title: "Held-out evaluations (success vs env steps)", label: "point",
      group: "series", main: "main", skip: ["temperature", "size"] },
    { kind: "rl_iter", x: "iteration", y: "reward", title: "RL: batch reward per iteration" },
    { kind: "rl_iter", x: "iteration", y: "success", title: "RL: batch success per iteration" },
    { kind: "rl_iter", x: "iteration", y: "update.entropy", title: "RL: policy entropy on action tokens" },
    { kind: "rl_iter", x: "iteration", y: "update.loss", title: "RL: loss" },
    { kind: "bc_epoch", x: "epoch", y: "loss", title: "Behaviour cloning: loss per epoch" },
    { kind: "flywheel_round", x: "round", y: "eval.success_rate", title: "Flywheel: held-out success per round" },
    { kind: "flywheel_round", x: "round", y: "entropy", title: "Flywheel: entropy per round" },
    { kind: "flywheel_round", x: "round", y: "pass_k_dropped", title: "Flywheel: kept episodes left out by flywheel.pass_k (weight 0)" },
  ];
  // a chart per pass@k measurement the records hold (result.pass_at_8, ...); not flywheel.pass_k's
  // pass_k_dropped, a count of episodes (its own chart above)
  for (const kind of ["rl_iter", "eval", "flywheel_round"]) {
    const cols = new Set(os.flatMap((o) => (o.series[kind] ? o.series[kind].columns : [])));
    const base = specs.find((s) => s.kind === kind);
    for (const c of cols) if (/pass_at_|pass@/i.test(c)) specs.push({ ...base, y: c, title: `pass@k: ${c}` });
  }
  return specs.filter((s) => has(s.kind, s.y));
}

function niceTicks(lo, hi, n = 5) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const step0 = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(+v.toFixed(10));
  return out;
}

// the marks of a chart's series: a run's own curve (its evaluations) as circles in the run's colour,
// each other series in a colour and mark of its own (the second run's dashed, its marks hollow)
const MARKS = ["circle", "square", "triangle", "diamond"];
const SERIES_COLORS = ["#2b8a3e", "#7048e8", "#c2255c", "#0c8599", "#8d6e63", "#e8590c", "#868e96"];

function markSvg(shape, x, y, color, hollow, attrs) {
  const paint = hollow ? `fill="#fff" stroke="${color}" stroke-width="1.6"` : `fill="${color}"`;
  const at = (v) => v.toFixed(2);
  if (shape === "square") return `<rect ${attrs} x="${at(x - 3.3)}" y="${at(y - 3.3)}" width="6.6" height="6.6" ${paint}`;
  if (shape === "triangle") return `<path ${attrs} d="M${at(x)},${at(y - 4.4)}L${at(x + 4.2)},${at(y + 3.2)}L${at(x - 4.2)},${at(y + 3.2)}Z" ${paint}`;
  if (shape === "diamond") return `<path ${attrs} d="M${at(x)},${at(y - 4.8)}L${at(x + 4.6)},${at(y)}L${at(x)},${at(y + 4.8)}L${at(x - 4.6)},${at(y)}Z" ${paint}`;
  return `<circle ${attrs} cx="${at(x)}" cy="${at(y)}" r="3.5" ${paint}`;
}

function drawSeries(plot, series, opts = {}) {
  // series: [{label, run, main, color, mark, points: [{x, y, title, link}]}]; a line joins the points
  // of one series only. opts: yRange (the least y range shown), xTicks ([value, label] pairs)
  const W = 560, H = 210, L = 46, R = 10, Tp = 8, B = 24;
  const pts = series.flatMap((s) => s.points);
  const svg = ['<svg viewBox="0 0 ' + W + " " + H + '" preserveAspectRatio="none" role="img">'];
  if (!pts.length) {
    svg.push(`<text x="${W / 2}" y="${H / 2}" text-anchor="middle" fill="#999" font-size="12">no data</text></svg>`);
    plot.innerHTML = svg.join("");
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p.x)), Math.max(...pts.map((p) => p.x))];
  let [y0, y1] = [Math.min(...pts.map((p) => p.y), ...(opts.yRange || [])), Math.max(...pts.map((p) => p.y), ...(opts.yRange || []))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const yt = niceTicks(y0, y1), xt = opts.xTicks || niceTicks(x0, x1).map((t) => [t, t]);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  const pad = opts.xTicks ? 0.04 * (x1 - x0) : 0;  // marks at the ends stay whole
  x0 -= pad; x1 += pad;
  const sx = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R), sy = (v) => H - B - ((v - y0) / (y1 - y0)) * (H - B - Tp);
  svg.push('<g class="grid axis">');
  for (const t of yt) svg.push(`<line x1="${L}" x2="${W - R}" y1="${sy(t)}" y2="${sy(t)}"/><text x="${L - 4}" y="${sy(t) + 3}" text-anchor="end">${esc(num(t))}</text>`);
  for (const [t, label] of xt) if (t >= x0 && t <= x1) svg.push(`<text x="${sx(t)}" y="${H - 8}" text-anchor="middle">${esc(num(label))}</text>`);
  svg.push("</g>");
  for (const s of series) {
    const dash = s.run === 1 ? ' stroke-dasharray="5 3"' : "";
    svg.push(`<g class="series" data-series="${esc(s.label)}" data-run="${s.run}" data-main="${s.main ? 1 : 0}">`);
    if (s.points.length > 1) svg.push(`<polyline fill="none" stroke="${s.color}" stroke-width="${s.main ? 1.8 : 1.4}"${dash} points="${s.points.map((p) => `${sx(p.x)},${sy(p.y)}`).join(" ")}"/>`);
    s.points.forEach((p, j) => {
      const attrs = `class="pt${p.link ? " link" : ""}" data-run="${s.run}" data-row="${j}" data-x="${p.x}" data-y="${p.y}"${p.link ? ` data-link="${esc(p.link)}"` : ""}`;
      svg.push(markSvg(s.mark, sx(p.x), sy(p.y), s.color, s.run === 1, attrs) + `><title>${esc(p.title)}</title></${s.mark === "circle" ? "circle" : s.mark === "square" ? "rect" : "path"}>`);
    });
    svg.push("</g>");
  }
  svg.push("</svg>");
  plot.innerHTML = svg.join("");
  plot.querySelectorAll(".pt.link").forEach((c) => c.addEventListener("click", () => { location.hash = c.dataset.link; }));
}

function seriesLegend(series) {
  // one entry per series label (the first series of that label shows its colour and mark); none for a single series
  const seen = new Map();
  for (const s of series) if (!seen.has(s.label)) seen.set(s.label, s);
  if (seen.size < 2) return null;
  return el("div", { class: "series-legend" }, [...seen.values()].map((s) => el("span", { "data-series": s.label },
    el("span", { class: "mk", html: `<svg viewBox="0 0 22 10" width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" stroke="${s.color}" stroke-width="1.6"/>` +
      markSvg(s.mark, 11, 5, s.color, false, "") + "/></svg>" }), s.label)));
}

function chartSeries(os, spec, y) {
  // each run's series of the chart: one, or with spec.group one per value of that column (held-out
  // evaluations: per sampling temperature and size, turnforge.view.rundir.eval_series), the run's
  // own (spec.main true) first; a label keeps its colour and mark in both runs; none for a run that
  // did not record y (recorded)
  const groups = os.map((o) => {
    const by = new Map();
    if (!recorded(o, spec.kind, y)) return [];
    for (const r of seriesRows(o, spec.kind)) {
      if (typeof r[y] !== "number" || typeof r[spec.x] !== "number") continue;
      const label = spec.group ? String(r[spec.group] ?? "") : "";
      if (!by.has(label)) by.set(label, { label, main: !spec.group || r[spec.main] !== false, rows: [] });
      by.get(label).rows.push(r);
    }
    return [...by.values()].sort((a, b) => b.main - a.main);
  });
  const others = [...new Set(groups.flat().filter((g) => !g.main).map((g) => g.label))];
  return groups.flatMap((gs, i) => gs.map((g) => {
    const k = others.indexOf(g.label), o = os[i];
    return { label: g.label || o.name, run: o.index, main: g.main, color: g.main ? RUN_COLORS[o.index] : SERIES_COLORS[k % SERIES_COLORS.length],
      mark: g.main ? "circle" : MARKS[1 + (k % (MARKS.length - 1))],
      points: g.rows.map((r) => {
        const link = CURVE_LINKS[spec.kind] ? hashOf("browse", { run: o.index, ...CURVE_LINKS[spec.kind](r) }) : null;
        return { x: r[spec.x], y: r[y], link, title: `${o.name} · ${g.label ? g.label + " · " : ""}${spec.x} ${num(r[spec.x])}` +
          `${spec.label ? " · " + r[spec.label] : ""} · ${y} ${num(r[y], 4)}` };
      }) };
  }));
}

function chart(os, spec) {
  const skip = new Set([spec.x, "time", ...(spec.skip || [])]);
  const numericCols = [...new Set(os.flatMap((o) => {
    const s = o.series[spec.kind];
    if (!s) return [];
    return s.columns.filter((c) => !skip.has(c) && recorded(o, spec.kind, c));
  }))];
  const box = el("div", { class: "chart", "data-kind": spec.kind });
  const select = el("select", { "aria-label": "metric" }, numericCols.map((c) => el("option", { value: c, selected: c === spec.y }, c)));
  const hint = CURVE_LINKS[spec.kind] ? "click a point: its episodes" : "";
  const plot = el("div", { class: "plot" }), legend = el("div");
  const draw = () => {
    const series = chartSeries(os, spec, select.value);
    drawSeries(plot, series);
    legend.replaceChildren((spec.group && seriesLegend(series)) || "");
  };
  select.addEventListener("change", draw);
  box.append(el("div", { class: "head" }, el("span", {}, spec.title), select), plot, legend, el("div", { class: "hint" }, hint));
  draw();
  return box;
}

async function viewOverview() {
  const os = state.overviews;
  const root = el("div", {}, el("h1", {}, os.length > 1 ? `${os[0].name} vs ${os[1].name}` : os[0].name));
  root.append(el("div", { class: "runs" + (os.length > 1 ? " two" : "") }, os.map(runPanel)));
  const specs = chartSpecs(os);
  if (specs.length) root.append(el("h2", {}, "Learning curves"), el("div", { class: "charts" }, specs.map((s) => chart(os, s))));
  // a section per run, two runs side by side; a wide one (wide: true) one above the other, each whole
  const perRun = (title, make, when = () => true, wide = false) => {
    const shown = os.filter(when);
    if (!shown.length) return;
    root.append(el("h2", {}, title), el("div", { class: "runs" + (shown.length > 1 && !wide ? " two" : "") },
      shown.map((o) => el("div", { class: "panel" }, os.length > 1 ? el("h3", {}, runTag(o.index)) : null, make(o)))));
  };
  perRun("pass@k: what the policy can solve", boundaryPanel, (o) => boundaryReports(o.summary).length > 0);
  perRun("Failures and truncations by stage", stagesTable, () => true, true);
  perRun("BC at each temperature", (o) => table([
    { label: "temperature", n: 1, get: (r) => r.temperature }, { label: "success", n: 1, get: (r) => pct(r.success_rate) },
    { label: "mean return", n: 1, get: (r) => num(r.mean_return) }, { label: "invalid actions", n: 1, get: (r) => pct(r.invalid_action_rate) },
    { label: "episodes", n: 1, get: (r) => r.episodes },
  ], o.bc_temperatures), (o) => o.bc_temperatures.length > 0);
  perRun("Flywheel rounds", (o) => table([
    { label: "round", n: 1, get: (r) => el("a", { href: hashOf("browse", { run: o.index, ...CURVE_LINKS.flywheel_round(r) }) }, r.round) },
    { label: "held-out success", n: 1, get: (r) => pct(r["eval.success_rate"]) },
    { label: "plain (episodes / successes)", n: 1, get: (r) => `${r["plain.0"]} / ${r["plain.1"]}` },
    ...mechanismColumns(o),
    { label: "unsolved tasks", n: 1, get: (r) => r.unsolved_tasks }, { label: "RFT samples", n: 1, get: (r) => r.rft_samples },
    { label: "entropy", n: 1, get: (r) => num(r.entropy) },
  ], seriesRows(o, "flywheel_round")), (o) => seriesRows(o, "flywheel_round").length > 0, true);
  perRun("Success by round (stored episodes)", roundsTable);
  perRun("Success by source", (o) => table([
    { label: "source", get: (r) => el("a", { href: hashOf("browse", { run: o.index, source: r.source }) }, r.source) },
    { label: "episodes", n: 1, get: (r) => num(r.episodes) }, { label: "success", n: 1, get: (r) => pct(r.success_rate) },
    { label: "mean reward", n: 1, get: (r) => num(r.mean_reward) }, { label: "infra failures", n: 1, get: (r) => num(r.infra_failures) },
  ], rowsOf(o.sources)));
  perRun("Warnings", (o) => el("ul", {}, o.warnings.map((w) => el("li", {}, w))), (o) => o.warnings.length > 0);
  perRun("Config and summary", (o) => el("div", {},
    el("details", { class: "config" }, el("summary", {}, "config.yaml"), el("pre", {}, o.config_text || "(none)")),
    el("details", { class: "config" }, el("summary", {}, "summary.json"), el("pre", {}, o.summary ? JSON.stringify(o.summary, null, 2) : "(none: the run has not finished)")),
    el("details", { class: "config" }, el("summary", {}, `trajectory files (${o.files.length})`), el("pre", {}, o.files.join("\n")))));
  return root;
}

// ---------------------------------------------------------------- browse
function chipFor(run, stage, iteration, m) {
  const cls = m.infra ? "infra" : m.success ? "ok" : "fail";
  const label = m.infra ? "fail" : num(m.reward, 2);
  const why = m.infra ? "infrastructure failure" : `${m.success ? "success" : "no success"}${m.truncated ? ", truncated: " + m.truncated : ""}`;
  return el("a", { class: `chip ${cls}`, href: hashOf("traj", { run, stage, iteration, id: m.trajectory_id }),
    title: `${m.trajectory_id}: reward ${num(m.reward)} (${why})`, "data-trajectory": m.trajectory_id }, label);
}

async function viewBrowse(params) {
  const os = state.overviews;
  const run = Math.min(+(params.run || 0), os.length - 1), o = os[run];
  const q = { ...params };
  delete q.run;
  const page = await state.src.groups(run, q);
  const root = el("div", {}, el("h1", {}, "Browse episodes", os.length > 1 ? el("span", {}, " · ", runTag(run)) : ""));
  const go = (changes) => { location.hash = hashOf("browse", { ...params, offset: undefined, ...changes }); };

  // filters
  const sel = (name, values, label) => el("label", {}, label, el("select", { name, onchange: (e) => go({ [name]: e.target.value, ...(name === "stage" ? { iteration: "" } : {}) }) },
    el("option", { value: "" }, "all"), values.map((v) => el("option", { value: v, selected: String(params[name] ?? "") === String(v) }, v))));
  const stageIters = params.stage ? (o.stages.find((s) => s.stage === params.stage) || { iterations: [] }).iterations : [];
  const input = (name, label, type = "text") => el("label", {}, label, el("input", { name, type, step: "any", value: params[name] ?? "",
    onchange: (e) => go({ [name]: e.target.value }) }));
  const filters = el("div", { class: "filters" },
    os.length > 1 ? el("label", {}, "run", el("select", { onchange: (e) => { location.hash = hashOf("browse", { run: e.target.value }); } },
      os.map((x, i) => el("option", { value: i, selected: i === run }, x.name)))) : null,
    sel("stage", o.facets.stages, "stage"), params.stage ? sel("iteration", stageIters, "iteration / round") : null,
    sel("source", o.facets.sources, "source"), sel("env", o.facets.envs, "env"), input("task", "task id contains"),
    sel("outcome", ["success", "failure", "infra", "truncated"], "outcome"),
    input("reward_min", "reward ≥", "number"), input("reward_max", "reward ≤", "number"),
    params.task_id ? el("label", {}, "task", el("span", {}, params.task_id, " ", el("a", { href: "#", title: "any task",
      onclick: (e) => { e.preventDefault(); go({ task_id: "" }); } }, "×"))) : null,
    el("label", {}, "order", el("select", { onchange: (e) => go({ sort: e.target.value }) },
      [["run", "run order"], ["spread", "widest reward spread"], ["best", "best reward"], ["worst", "worst reward"]].map(([v, t]) =>
        el("option", { value: v, selected: (params.sort || "run") === v }, t)))),
    el("button", { onclick: () => { location.hash = hashOf("browse", { run }); } }, "clear"));

  // rounds list
  const rounds = rowsOf(o.rounds);
  const list = el("div", { class: "rounds-list" });
  list.append(el("a", { href: hashOf("browse", { run }), class: !params.stage ? "sel" : "" }, el("span", {}, "all episodes"), el("span", { class: "muted" }, num(o.totals.episodes))));
  let lastStage = null;
  for (const r of rounds) {
    if (r.stage !== lastStage) {
      list.append(el("div", { class: "stagehead" }, r.stage));
      lastStage = r.stage;
    }
    const selected = params.stage === r.stage && String(params.iteration ?? "") === String(r.iteration);
    list.append(el("a", { href: hashOf("browse", { run, stage: r.stage, iteration: r.iteration }), class: selected ? "sel" : "",
      title: `${r.episodes} episodes, success ${pct(r.success_rate)}, mean reward ${num(r.mean_reward)}` },
      el("span", {}, `${r.stage === "flywheel" ? "round" : "iteration"} ${r.iteration}`), el("span", { class: "muted" }, `${num(r.episodes)} · ${pct(r.success_rate)}`)));
  }

  // groups
  const groups = rowsOf(page.rows);
  const limit = +(params.limit || 50), offset = page.offset;
  const summary = el("div", { class: "pager", "data-testid": "match-count", "data-episodes": page.total_episodes, "data-groups": page.total_groups },
    el("span", {}, `${num(page.total_episodes)} episodes in ${num(page.total_groups)} groups`),
    offset > 0 ? el("button", { class: "b", onclick: () => go({ offset: Math.max(0, offset - limit) }) }, "‹ previous") : null,
    page.total_groups > offset + limit ? el("button", { class: "b", onclick: () => go({ offset: offset + limit }) }, "next ›") : null,
    page.total_groups ? el("span", { class: "muted" }, `groups ${offset + 1}–${Math.min(offset + limit, page.total_groups)}`) : null);
  const rows = table([
    { label: "stage", get: (g) => g.stage }, { label: "it.", n: 1, get: (g) => g.iteration },
    { label: "group", get: (g) => el("a", { href: hashOf("group", { run, stage: g.stage, iteration: g.iteration, group: g.group_id }) }, g.group_id) },
    { label: "task", get: (g) => el("a", { href: hashOf("browse", { run, task_id: g.task_id }), title: "every group of this task" }, g.task_id) },
    { label: "attempts (reward; green = success)", get: (g) => el("div", { class: "chips" }, g.members.map((m) => chipFor(run, g.stage, g.iteration, m))) },
    { label: "success", n: 1, get: (g) => `${g.successes}/${g.n}` }, { label: "mean", n: 1, get: (g) => num(g.mean_reward) },
    { label: "best", n: 1, get: (g) => num(g.best) }, { label: "worst", n: 1, get: (g) => num(g.worst) },
  ], groups, { cls: "groups", attrs: (g) => ({ "data-group": g.group_id, class: "click group" }),
    onclick: (g) => { location.hash = hashOf("group", { run, stage: g.stage, iteration: g.iteration, group: g.group_id }); } });
  root.append(filters, el("div", { class: "browse" }, list, el("div", {}, summary, groups.length ? rows : el("p", { class: "muted" }, "No episode matches these filters."))));
  return root;
}

// ---------------------------------------------------------------- group
const ROLE_LINE = /^\s*(system|user|assistant|tool|ipython|observation|environment)\s*(\n|$)/;
function attemptLines(t, vocab) {
  // one line per action (a run of trained tokens), decoded from the recorded ids, with what the
  // policy saw before it that the previous turn's context did not hold (its new observation).
  // For that display only, the context is cut at special tokens and a segment's leading chat
  // role line is dropped; the trajectory view shows every token.
  const lines = [];
  let previous = [], previousFrom = 0;
  for (const s of t.samples) {
    const texts = tokenTexts(s.ids, vocab);
    const firstAction = s.mask.indexOf(1);
    let from = 0;
    if (s.turn_index >= 0 && firstAction >= 0) {  // one turn per sample: from the last special token the previous context shares
      let same = 0;
      while (same < previous.length && same < firstAction && previous[same] === s.ids[same]) same++;
      if (same === firstAction && same === previous.length) from = previousFrom;  // the same context again: the same observation
      else for (let k = 0; k < same; k++) if (texts[k].special) from = k;
      previous = Array.from(s.ids).slice(0, firstAction);
      previousFrom = from;
    }
    let segments = [""];
    for (let k = from; k < s.ids.length; k++) {
      if (s.mask[k]) {
        let action = "";
        while (k < s.ids.length && s.mask[k]) action += texts[k++].text;
        k--;
        const observation = segments.map((x) => x.replace(ROLE_LINE, "")).filter((x) => x.trim()).join("\n").trim();
        lines.push({ text: oneLine(action), observation, reward: s.turn_index >= 0 ? s.turn_reward : null });
        segments = [""];
      } else if (texts[k].special) segments.push("");
      else segments[segments.length - 1] += texts[k].text;
    }
  }
  return lines;
}

const clip = (text, n = 600) => (text.length > n ? "…" + text.slice(text.length - n) : text);

function diffLines(a, b) {
  // longest common subsequence of two line lists -> [{op: "same"|"del"|"add", text}]
  const n = a.length, m = b.length;
  if (n * m > 4e6) return [...a.map((text) => ({ op: "del", text })), ...b.map((text) => ({ op: "add", text }))];
  const L = Array.from({ length: n + 1 }, () => new Int32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--) L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const out = [];
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) { out.push({ op: "same", text: a[i] }); i++; j++; }
    else if (L[i + 1][j] >= L[i][j + 1]) out.push({ op: "del", text: a[i++] });
    else out.push({ op: "add", text: b[j++] });
  }
  while (i < n) out.push({ op: "del", text: a[i++] });
  while (j < m) out.push({ op: "add", text: b[j++] });
  return out;
}

function outcomeBadge(e) {
  if (e.infra_failure !== null) return el("span", { class: "badge infra" }, "infra failure");
  return el("span", { class: `badge ${e.success ? "ok" : "fail"}` }, e.success ? "success" : "no success");
}

async function viewGroup(params) {
  const run = +(params.run || 0), iteration = +params.iteration;
  const detail = await state.src.group(run, params.stage, iteration, params.group);
  const vocab = state.src.vocab(run);
  const ts = detail.trajectories;
  const scored = ts.filter((t) => t.episode.reward !== null);
  const best = scored[0], worst = scored[scored.length - 1];
  const root = el("div", {},
    el("div", { class: "crumbs" }, el("a", { href: hashOf("browse", { run, stage: params.stage, iteration }) }, `${params.stage} ${iteration}`), ` › group ${params.group}`),
    el("h1", {}, `Group ${params.group} · ${ts[0].episode.task_id}`),
    el("p", { class: "muted" }, `${ts.length} attempts at one task, best reward first. Actions are decoded from the recorded tokens.`));
  const lines = new Map(ts.map((t) => [t.episode.trajectory_id, attemptLines(t, vocab)]));
  const showObs = params.obs !== "0";
  root.append(el("div", { class: "toolbar" }, el("label", {}, el("input", { type: "checkbox", checked: showObs,
    onchange: (ev) => { location.hash = hashOf("group", { ...params, obs: ev.target.checked ? undefined : "0" }); } }),
  " show what each action saw (the new part of its context)")));
  const cols = el("div", { class: "attempts" }, ts.map((t) => {
    const e = t.episode;
    const spread = best && worst && best.episode.reward !== worst.episode.reward;
    const cls = "attempt" + (spread && t === best ? " best" : spread && t === worst ? " worst" : "");
    return el("div", { class: cls, "data-trajectory": e.trajectory_id },
      el("div", { class: "ah" }, el("a", { href: hashOf("traj", { run, stage: e.stage, iteration: e.iteration, id: e.trajectory_id }) }, e.trajectory_id),
        el("b", {}, `reward ${num(e.reward)}`)),
      el("div", { class: "small muted" }, outcomeBadge(e), ` ${e.num_turns} turns`, e.truncation_reason ? ` · truncated: ${e.truncation_reason}` : "",
        e.judge_score !== null ? ` · judge ${num(e.judge_score)} (verifier ${num(e.verifier_reward)})` : ""),
      e.infra_failure !== null ? el("pre", { class: "error" }, e.infra_failure.split("\n").slice(0, 4).join("\n")) : null,
      el("ol", {}, lines.get(e.trajectory_id).map((l) => el("li", {},
        showObs && l.observation ? el("div", { class: "obs" }, clip(l.observation)) : null,
        el("span", { class: "act" }, l.text), l.reward !== null ? el("span", { class: "r" }, `  (${num(l.reward)})`) : ""))));
  }));
  root.append(cols);
  if (best && worst && best !== worst) {
    const d = diffLines(lines.get(best.episode.trajectory_id).map((l) => l.text), lines.get(worst.episode.trajectory_id).map((l) => l.text));
    const same = best.episode.reward === worst.episode.reward;
    root.append(el("h2", {}, same ? `${best.episode.trajectory_id} against ${worst.episode.trajectory_id} (the same reward, ${num(best.episode.reward)})`
      : `Best (${best.episode.trajectory_id}, ${num(best.episode.reward)}) against worst (${worst.episode.trajectory_id}, ${num(worst.episode.reward)})`),
      el("p", { class: "muted small" }, `Action by action: + only in ${best.episode.trajectory_id} (green), − only in ${worst.episode.trajectory_id} (red).`),
      el("div", { class: "diff", "data-testid": "diff" }, d.map((x) => el("div", { class: { same: "same", del: "only-best", add: "only-worst" }[x.op] }, x.text))));
  }
  return root;
}

// ---------------------------------------------------------------- trajectory
function tokenHtml(s, texts, mode, adv, maxAdv) {
  const parts = [];
  for (let k = 0; k < s.ids.length; k++) {
    const t = texts[k], m = s.mask[k], lp = s.logprobs[k], v = s.versions[k];
    const sampled = lp !== null && lp !== undefined && !Number.isNaN(lp);
    let bg = "";
    if (m) {
      if (mode === "mask") bg = "background:rgba(26,127,75,.20)";
      else if (mode === "logprob") bg = sampled ? `background:hsla(${Math.round(120 * Math.exp(lp))},78%,55%,.42)` : "background:rgba(240,200,60,.35)";
      else if (mode === "advantage") {
        const a = adv ?? 0, alpha = maxAdv > 0 ? 0.12 + 0.55 * Math.min(1, Math.abs(a) / maxAdv) : 0.12;
        bg = a > 0 ? `background:rgba(47,111,223,${alpha.toFixed(3)})` : a < 0 ? `background:rgba(192,57,43,${alpha.toFixed(3)})` : "background:rgba(140,150,165,.25)";
      }
    }
    const title = `#${k} · id ${s.ids[k]} · ${m ? "trained (loss mask 1)" : "context (loss mask 0)"}` +
      (sampled ? ` · logprob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(4)})` : "") + (v >= 0 ? ` · policy version ${v}` : "");
    let text = t.text, cls = "tok " + (m ? "act" : "ctx");
    if (t.special) cls += " special";
    if (k >= s.ids.length - (s.summary_tokens || 0)) cls += " summary";
    if (k >= s.memory_start && k < s.memory_start + (s.memory_tokens || 0)) cls += " memory";
    if (text === "") { cls += " partial"; text = "·"; }
    const shown = t.special ? esc(text) : visible(esc(text));
    parts.push(`<span class="${cls}" data-k="${k}" data-id="${s.ids[k]}" style="${bg}" title="${esc(title)}">${shown}</span>`);
  }
  return parts.join("");
}

const MODES = { mask: "loss mask", logprob: "sampling logprob", advantage: "advantage" };
function legend(mode) {
  const sw = (style, label) => el("span", {}, el("span", { class: "sw", style }), " ", label);
  if (mode === "mask") return el("span", { class: "legend" }, sw("background:#fff", "context (not trained)"), sw("background:rgba(26,127,75,.2)", "trained (the policy's or expert's action)"));
  if (mode === "logprob") return el("span", { class: "legend" }, sw("background:hsla(0,78%,55%,.42)", "p≈0"), sw("background:hsla(60,78%,55%,.42)", "p≈0.5"),
    sw("background:hsla(120,78%,55%,.42)", "p≈1"), sw("background:rgba(240,200,60,.35)", "trained, not sampled (demonstration)"));
  return el("span", { class: "legend" }, sw("background:rgba(47,111,223,.6)", "positive advantage"), sw("background:rgba(192,57,43,.6)", "negative"),
    sw("background:rgba(140,150,165,.25)", "zero / none"));
}

async function viewTrajectory(params) {
  const run = +(params.run || 0), iteration = +params.iteration;
  const detail = await state.src.trajectory(run, params.stage, iteration, params.id);
  const vocab = state.src.vocab(run);
  const t = detail.trajectories[0], e = t.episode;
  const mode = MODES[params.color] ? params.color : "mask";
  const nTokens = t.samples.reduce((a, s) => a + s.ids.length, 0), nTrained = t.samples.reduce((a, s) => a + s.mask.reduce((x, y) => x + y, 0), 0);
  const root = el("div", {},
    el("div", { class: "crumbs" }, el("a", { href: hashOf("browse", { run, stage: e.stage, iteration }) }, `${e.stage} ${iteration}`), " › ",
      el("a", { href: hashOf("group", { run, stage: e.stage, iteration, group: e.group_id }) }, `group ${e.group_id}`), ` › ${e.trajectory_id}`),
    el("h1", {}, `Trajectory ${e.trajectory_id}`, state.overviews.length > 1 ? el("span", {}, " · ", runTag(run)) : ""));
  const kv = el("div", { class: "kv", "data-testid": "episode" });
  const add = (k, v) => kv.append(el("span", { class: "k" }, k), el("span", {}, v));
  add("outcome", outcomeBadge(e));
  add("reward", num(e.reward, 4));
  add("task", e.task_id);
  add("stage · iteration · source", `${e.stage} · ${e.iteration} · ${e.source}`);
  add("turns · samples", `${e.num_turns} · ${t.samples.length}`);
  add("tokens", `${num(nTokens)} (${num(nTrained)} trained)`);
  add("policy version", e.policy_version);
  add("truncation", e.truncation_reason ?? "none");
  if (t.turn_advantages) add("turn advantages", t.turn_advantages.map((a) => num(a, 3)).join(", "));
  add("env seed", String(t.env_seed ?? "–"));
  root.append(el("div", { class: "panel" }, kv));
  if (e.infra_failure !== null) root.append(el("h2", {}, "Infrastructure failure (not scored)"), el("pre", { class: "error", "data-testid": "infra-failure" }, e.infra_failure));
  if (t.judge_prompt !== null || t.judge_output !== null || e.judge_score !== null) {
    root.append(el("h2", {}, "Judge"), el("div", { class: "cards", "data-testid": "judge" }, card("judge score", num(e.judge_score), "judge-score"),
      card("verifier reward", num(e.verifier_reward), "verifier-reward"), card("reward used", num(e.reward), "judge-reward")),
    el("div", { class: "judge" }, el("div", {}, el("h3", {}, "prompt the judge saw"), el("pre", { class: "block" }, t.judge_prompt ?? "")),
      el("div", {}, el("h3", {}, "judge output"), el("pre", { class: "block" }, t.judge_output ?? ""))));
  }
  const toolbar = el("div", { class: "toolbar" }, el("span", {}, "colour by"),
    Object.entries(MODES).map(([k, label]) => el("label", {}, el("input", { type: "radio", name: "color", value: k, checked: k === mode,
      onchange: () => { location.hash = hashOf("traj", { ...params, color: k }); } }), " ", label)), legend(mode));
  root.append(el("h2", {}, "Turns, token by token"), toolbar);
  if (vocab.none) root.append(el("div", { class: "note" }, "No tokenizer in the run directory: each token shows as its id."));
  const maxAdv = Math.max(0, ...t.samples.map((s) => Math.abs(s.advantage ?? 0)));
  t.samples.forEach((s, j) => {
    const texts = tokenTexts(s.ids, vocab);
    const trained = s.mask.reduce((a, b) => a + b, 0);
    const versions = [...new Set(Array.from(s.versions).filter((v) => v >= 0))];
    const actions = actionRuns(s, texts).map((r) => r.text);
    const segmented = s.turn_index < 0 && (t.samples.length > 1 || s.summary_tokens > 0);
    const what = s.turn_index >= 0 ? `turn ${s.turn_index}` : segmented
      ? `segment ${s.segment_index}${s.parent_segment >= 0 ? ` (continues ${s.parent_segment})` : ""} · from turn ${s.first_turn}`
      : "whole episode";
    const head = el("div", { class: "th", "data-testid": segmented ? "segment" : null }, el("b", {}, what),
      s.summary_tokens > 0 ? el("span", { class: "muted" }, `ends with its summary (${s.summary_tokens} tokens, outlined)`) : null,
      s.memory_tokens > 0 ? el("span", { class: "muted", "data-testid": "memory" }, `recalled memory: ${s.memory_tokens} tokens, underlined`) : null,
      s.action_text !== null ? el("span", {}, "action ", el("code", {}, JSON.stringify(s.action_text))) : null,
      s.turn_reward !== null ? el("span", {}, `turn reward ${num(s.turn_reward, 4)}`) : null,
      el("span", {}, `advantage ${num(s.advantage, 4)}`), el("span", { class: "muted" }, `${s.ids.length} tokens, ${trained} trained`),
      versions.length ? el("span", { class: "muted" }, `sampled by policy version ${versions.join(", ")}`) : el("span", { class: "muted" }, "not sampled by a policy"),
      actions.length > 1 ? el("span", { class: "muted" }, `${actions.length} model calls`) : null);
    const shots = (s.images || []).length ? el("div", { class: "shots", "data-testid": "images" },
      el("span", { class: "muted" }, `the ${s.images.length === 1 ? "image" : `${s.images.length} images`} its image tokens stand for, in order`),
      s.images.map((sha) => { const url = state.src.imageUrl(run, sha);
        return url ? el("img", { src: url, alt: `image ${sha.slice(0, 12)}`, title: sha }) : el("code", { title: "not embedded: turnforge view --serve shows it" }, sha.slice(0, 12)); })) : null;
    root.append(el("div", { class: "turn", "data-sample": j, "data-turn": s.turn_index }, head, shots,
      el("div", { class: "tokens", html: tokenHtml(s, texts, mode, s.advantage, maxAdv) })));
  });
  if (t.splits.length) {
    root.append(el("h2", {}, `Gateway splits (${t.splits.length})`), el("p", { class: "muted small" },
      "Calls whose history did not extend the previous sample start a new one: what the gateway expected against what the agent sent."),
    table([{ label: "call", n: 1, get: (r) => r.call }, { label: "reason", get: (r) => r.reason }, { label: "position", n: 1, get: (r) => r.position },
      { label: "expected", get: (r) => el("pre", {}, r.expected) }, { label: "got", get: (r) => el("pre", {}, r.got) }], t.splits, { cls: "splits" }));
  }
  // the same task elsewhere: in this run and, with two runs, in the other
  const others = el("div", { class: "side" });
  for (let i = 0; i < state.overviews.length; i++) {
    const eps = (await state.src.sameTask(i, e.task_id)).filter((x) => !(i === run && x.trajectory_id === e.trajectory_id && x.stage === e.stage));
    others.append(el("div", { class: "panel", "data-testid": `same-task-${i}` }, el("h3", {}, runTag(i), ` · ${eps.length} other episodes of this task`),
      eps.length ? table([
        { label: "episode", get: (x) => el("a", { href: hashOf("traj", { run: i, stage: x.stage, iteration: x.iteration, id: x.trajectory_id }) }, x.trajectory_id) },
        { label: "stage", get: (x) => `${x.stage} ${x.iteration}` }, { label: "reward", n: 1, get: (x) => num(x.reward) }, { label: "outcome", get: outcomeBadge },
      ], eps.slice(0, 50)) : el("p", { class: "muted" }, "none")));
  }
  root.append(el("h2", {}, "The same task"), others);
  return root;
}

// ---------------------------------------------------------------- start
(async function main() {
  try {
    state.src = BOOT.mode === "file" ? await FileSource.load(BOOT.runs) : new ServerSource(BOOT.runs);
  } catch (err) {
    app().replaceChildren(el("div", { class: "error" }, "cannot read the page's data: " + err));
    return;
  }
  window.addEventListener("hashchange", route);
  await route();
})();

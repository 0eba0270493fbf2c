// miles-env view: a hash-routed single page over the viewer's read-only JSON API (view/app.py).
// Pages: #/run (charts), #/episodes (server-paged table), #/episode/ID (conversation, commands,
// verifier, tokens), #/group/ID (one GRPO group side by side). /api/live is polled every 2 s:
// new metrics rows and new or changed episodes re-render the page that shows them.
"use strict";
const S = { run: null, metrics: [], live: null, table: { offset: 0, limit: 100, sort: "", desc: true, f: {} }, tok: null };
const $ = sel => document.querySelector(sel);
const api = async path => { const r = await fetch(path); if (!r.ok) throw new Error((await r.json()).error || r.statusText); return r.json(); };
const num = v => (v === null || v === undefined) ? "–" : fmt(v);
const pill = s => `<span class="pill ${esc(s)}">${esc(s)}</span>`;

async function loadMetrics() {
  const d = await api(`/api/metrics?since=${S.metrics.length}`);
  S.metrics.push(...d.rows);
}

function series(kind, key) {
  return S.metrics.filter(r => r.kind === kind && key in r).map(r => [r.step, r[key]]);
}

function pickKeys(pred) {
  const keys = new Set();
  for (const r of S.metrics) for (const k of Object.keys(r)) if (pred(k)) keys.add(k);
  return [...keys];
}

function renderRun() {
  const main = $("#main");
  const train = S.metrics.filter(r => r.kind === "train"), evals = S.metrics.filter(r => r.kind === "eval");
  const last = train[train.length - 1] || {}, firstEval = evals[0] || {}, lastEval = evals[evals.length - 1] || {};
  const cfg = S.run.config || {};
  const card = (k, v) => `<div class="card"><div class="k">${k}</div><div class="v">${v}</div></div>`;
  main.innerHTML = `<h2>Run <span class="muted">${esc(S.run.kind)}</span></h2><div class="cards" data-testid="cards">` +
    card("step", `<span data-testid="step">${last.step ?? 0}</span>${cfg.trainer ? " / " + cfg.trainer.steps : ""}`) +
    card("train reward", num(last.reward_mean)) + card("train pass", num(last.pass_rate)) +
    card("eval pass: first → last", `${num(firstEval.pass_rate)} → ${num(lastEval.pass_rate)}`) +
    card("episodes", S.live ? S.live.episodes : "–") + card("env", esc(cfg.env || "–")) +
    card("model", esc(String(((cfg.engine || {}).model) || S.run.model || "–")).split("/").pop()) +
    (S.run.summary && S.run.kind === "eval" ? card("eval pass rate", `<span data-testid="eval-pass">${num(S.run.summary.pass_rate)}</span>`) +
      card("mean reward", num(S.run.summary.mean_reward)) + card("sampled tokens", S.run.summary.sampled_tokens) : "") +
    `</div><div class="charts" id="charts"></div>`;
  const charts = $("#charts");
  if (!S.metrics.length) {
    charts.outerHTML = `<p class="muted" data-testid="no-metrics">No metrics.jsonl in this directory (${esc(S.run.kind === "store" ? "a proxy store" : S.run.kind === "eval" ? "an eval output" : "a run that has not logged a step yet")}): its episodes are under <a href="#/episodes">Episodes</a>.</p>`;
    return;
  }
  const add = (t, s, o) => charts.appendChild(lineChart(t, s, o));
  add("Train reward and pass rate", [{ name: "reward (mean)", points: series("train", "reward_mean") },
    { name: "pass rate", points: series("train", "pass_rate"), dashed: true }], { yMin: 0, yMax: 1 });
  add("Eval pass rate (before / every N / after)", [{ name: "pass rate", points: series("eval", "pass_rate") },
    { name: "reward (mean)", points: series("eval", "reward_mean"), dashed: true }], { yMin: 0, yMax: 1 });
  add("Logprob diff, trainer vs engine (Zero-KL)", [{ name: "mean |Δ logp|", points: series("train", "logprob_diff_mean") },
    { name: "max", points: series("train", "logprob_diff_max"), dashed: true }], { yMin: 0 });
  add("Staleness (steps behind)", [{ name: "mean", points: series("train", "staleness_mean") }], { yMin: 0 });
  const infra = pickKeys(k => /^ends\//.test(k) && !/\/(completed|truncated|policy_format)$/.test(k));
  add("Infrastructure failures (share of episodes rolled out)", infra.map(k => ({ name: k.slice(5), points: series("train", k) })),
    { yMin: 0, yMax: 1 });
  add("Clip fraction", [{ name: "clip_frac", points: series("train", "clip_frac") }], { yMin: 0 });
  add("Tokens / s (trainer)", [{ name: "tokens/s", points: series("train", "tokens_per_s") }], { yMin: 0 });
  const times = ["step_time_s", "rollout_s", "train_s", "sync_s", "checkpoint_s", "rollout_wait_s"];
  add("Step, rollout and sync times (s)", times.map(k => ({ name: k.replace(/_s$/, ""), points: series("train", k) })), { yMin: 0 });
  const cache = pickKeys(k => /cache_hit/.test(k));  // a rate in [0, 1]; the token counts are not charted
  add("Prefix-cache hit rate", cache.map(k => ({ name: k, points: series("train", k) })),
    { yMin: 0, yMax: 1, empty: "not reported by this engine" });
  add("Loss and grad norm", [{ name: "loss", points: series("train", "loss") }, { name: "grad_norm", points: series("train", "grad_norm"), dashed: true }]);
}

function tableQuery() {
  const t = S.table, p = new URLSearchParams({ offset: t.offset, limit: t.limit, sort: t.sort, desc: t.desc ? "1" : "0" });
  for (const [k, v] of Object.entries(t.f)) if (v) p.set(k, v);
  return p.toString();
}

const COLS = [["id", "episode"], ["task", "task"], ["status", "status"], ["end", "end"], ["reward", "reward"], ["group", "group"],
  ["split", "split"], ["step", "step"], ["v_min", "versions"], ["turns", "turns"], ["sampled", "sampled tok"], ["wall_s", "wall s"]];

function renderEpisodesShell() {
  const f = S.table.f, facets = S.run.facets || {};
  const sel = (name, opts) => `<select data-f="${name}" data-testid="f-${name}"><option value="">${name}: all</option>` +
    opts.map(o => `<option ${f[name] === o ? "selected" : ""}>${esc(o)}</option>`).join("") + "</select>";
  $("#main").innerHTML = `<h2>Episodes</h2><div class="filters">
    <input data-f="q" data-testid="f-q" placeholder="search task, id, group" value="${esc(f.q || "")}">
    ${sel("status", facets.status || [])}${sel("end", ["policy", "infra", ...(facets.end || [])])}${sel("split", facets.split || [])}${sel("state", facets.state || [])}
    ${sel("flag", ["any", "none", ...(facets.flag || [])])}
    <select data-f="passed" data-testid="f-passed"><option value="">reward: all</option><option value="1" ${f.passed === "1" ? "selected" : ""}>passed</option><option value="0" ${f.passed === "0" ? "selected" : ""}>not passed</option></select>
    <input data-f="step" data-testid="f-step" placeholder="step" size="5" value="${esc(f.step || "")}">
    <span id="count" class="muted" data-testid="count"></span></div>
    <table data-testid="episodes"><thead><tr>${COLS.map(([k, l]) => `<th data-k="${k}">${l}</th>`).join("")}</tr></thead><tbody id="rows"></tbody></table>
    <div class="pager"><button id="prev">‹ prev</button><button id="next">next ›</button><span id="range" class="muted"></span></div>`;
  for (const el of document.querySelectorAll("[data-f]")) {
    el.addEventListener(el.tagName === "INPUT" ? "input" : "change", () => { S.table.f[el.dataset.f] = el.value; S.table.offset = 0; loadTable(); });
  }
  for (const th of document.querySelectorAll("th[data-k]")) {
    th.addEventListener("click", () => { const k = th.dataset.k; S.table.desc = S.table.sort === k ? !S.table.desc : true; S.table.sort = k; S.table.offset = 0; loadTable(); });
  }
  $("#prev").onclick = () => { S.table.offset = Math.max(0, S.table.offset - S.table.limit); loadTable(); };
  $("#next").onclick = () => { S.table.offset += S.table.limit; loadTable(); };
  $("#rows").addEventListener("click", e => {
    const a = e.target.closest("a"); if (a) return;
    const tr = e.target.closest("tr[data-id]"); if (tr) location.hash = `#/episode/${encodeURIComponent(tr.dataset.id)}`;
  });
  loadTable();
}

let tableSeq = 0;
async function loadTable() {
  const seq = ++tableSeq, d = await api(`/api/episodes?${tableQuery()}`);
  if (seq !== tableSeq || !$("#rows")) return;  // a newer query (typing) or another page won
  const t = S.table;
  $("#rows").innerHTML = d.rows.map(r => `<tr data-id="${esc(r.id)}"><td><a href="#/episode/${encodeURIComponent(r.id)}">${esc(r.id.slice(0, 12))}</a></td>
    <td>${esc(r.task)}</td><td>${pill(r.status)}${(r.flags || []).map(f => ` <b class="err" title="flag">${esc(f)}</b>`).join("")}</td><td>${r.end ? pill(r.end) : "–"}</td><td class="num">${num(r.reward)}</td>
    <td><a href="#/group/${encodeURIComponent(r.group)}">${esc(r.group.slice(-24))}</a></td><td>${esc(r.split)}</td>
    <td class="num">${r.step ?? "–"}</td><td class="num">${r.v_min === null ? "–" : r.v_min === r.v_max ? r.v_min : r.v_min + "–" + r.v_max}</td>
    <td class="num">${r.turns}</td><td class="num">${r.sampled}</td><td class="num">${num(r.wall_s)}</td></tr>`).join("");
  $("#count").textContent = `${d.total} episodes`;
  $("#count").dataset.total = d.total;
  $("#range").textContent = d.total ? `${t.offset + 1}–${Math.min(d.total, t.offset + d.rows.length)} of ${d.total}` : "none";
  $("#prev").disabled = t.offset === 0; $("#next").disabled = t.offset + t.limit >= d.total;
  for (const th of document.querySelectorAll("th[data-k]")) {
    th.classList.toggle("sorted", th.dataset.k === t.sort); th.classList.toggle("asc", th.dataset.k === t.sort && !t.desc);
  }
  document.body.dataset.tableReady = String(seq);
  requestAnimationFrame(() => { document.body.dataset.tablePaint = performance.now().toFixed(1); });
}

function renderContent(c) {
  if (typeof c === "string") return `<pre>${esc(c)}</pre>`;
  if (!Array.isArray(c)) return c ? `<pre>${esc(JSON.stringify(c, null, 1))}</pre>` : "";
  return c.map(b => {
    if (b.type === "text") return `<pre>${esc(b.text)}</pre>`;
    if (b.type === "thinking" || b.type === "reasoning") return `<pre class="reasoning">${esc(b.thinking || b.text || "")}</pre>`;
    if (b.type === "tool_use") return `<pre class="call">→ ${esc(b.name)} ${esc(JSON.stringify(b.input))}</pre>`;
    if (b.type === "tool_result") return `<div class="muted">← result${b.is_error ? " (error)" : ""}</div>${renderContent(b.content)}`;
    return `<pre>${esc(JSON.stringify(b))}</pre>`;
  }).join("");
}

function renderMessage(m) {
  const reasoning = m.reasoning_content || m.reasoning;
  const calls = (m.tool_calls || []).map(c => `<pre class="call">→ ${esc(c.function?.name)} ${esc(c.function?.arguments)}</pre>`).join("");
  return `<div class="msg ${esc(m.role)}"><div class="role">${esc(m.role)}${m.name ? " · " + esc(m.name) : ""}</div>` +
    (reasoning ? `<pre class="reasoning">${esc(reasoning)}</pre>` : "") + renderContent(m.content) + calls + "</div>";
}

async function renderEpisode(id) {
  $("#main").innerHTML = `<p class="muted">loading ${esc(id)}…</p>`;
  const e = await api(`/api/episodes/${encodeURIComponent(id)}`), r = e.row;
  const checks = ((e.reward || {}).details || {}).checks || [];
  $("#main").innerHTML = `<h2>Episode ${esc(r.id)} ${pill(r.status)}${r.end && r.end !== r.status ? " " + pill(r.end) : ""}</h2>
    <div class="cards">${[["task", esc(r.task)], ["reward", num(r.reward)], ["group", `<a href="#/group/${encodeURIComponent(r.group)}">${esc(r.group)}</a>`],
      ["step", r.step ?? "–"], ["versions", r.v_min === null ? "–" : `${r.v_min}–${r.v_max}`], ["turns", r.turns], ["sampled", r.sampled],
      ["wall s", num(r.wall_s)], ["harness", esc(e.harness || "–")]].map(([k, v]) => `<div class="card"><div class="k">${k}</div><div class="v">${v}</div></div>`).join("")}</div>
    ${e.error ? `<div class="box err">${esc(e.error)}</div>` : ""}
    ${(e.flags || []).length ? `<div class="box err" data-testid="flags">flags: ${e.flags.map(f => `<b>${esc(f)}</b> (${((e.guards || {})[f] || []).map(x => esc(x.why || x.path || "")).join("; ")})`).join(", ")}</div>` : ""}
    <h3>Verifier</h3><div class="box" data-testid="verifier">${e.reward ? `score <b>${num(e.reward.score)}</b>` : "<span class=muted>no reward recorded</span>"}
      ${checks.length ? `<table><tr><th>check</th><th>target</th><th>passed</th><th>reason</th></tr>${checks.map(c => `<tr><td>${esc(c.kind || "")}</td><td>${esc(c.target || c.path || "")}</td><td>${pill(c.passed ? "pass" : "fail")}</td><td>${esc(c.reason || "")}</td></tr>`).join("")}</table>` : ""}</div>
    <h3>Sandbox commands</h3><div class="box" data-testid="commands">${e.commands.length ? `<table><tr><th>#</th><th>command</th><th>exit</th><th>duration s</th><th>output</th></tr>${e.commands.map((c, i) =>
      `<tr class="cmd"><td>${i + 1}</td><td><pre>${esc(c.command)}</pre></td><td>${c.exit_code ?? "–"}</td><td>${num(c.duration_s)}</td><td><pre>${esc((c.output || "").slice(0, 600))}</pre></td></tr>`).join("")}</table>` : "<span class=muted>none recorded</span>"}</div>
    <h3>Conversation (as the harness saw it)</h3><div class="box" data-testid="conversation">${e.transcript.length ? e.transcript.map(renderMessage).join("") : "<span class=muted>no transcript in this directory (a proxy store holds tokens only)</span>"}</div>
    ${e.decoded.length ? `<h3>Turns decoded from the tokens <span class="muted">(the model's view: prompt added since the last turn, then the completion)</span></h3><div class="box" data-testid="decoded">${e.decoded.map(t =>
      `<div class="msg user"><div class="role">prompt${t.turn === null ? " (after the last turn)" : ` before turn ${t.turn}`}</div><pre>${esc(t.prompt.slice(-4000))}</pre></div>` +
      (t.turn === null ? "" : `<div class="msg assistant"><div class="role">turn ${t.turn} · v${t.weight_version} · ${esc(t.finish_reason)}</div><pre>${esc(t.completion)}</pre></div>`)).join("")}</div>` : ""}
    <h3>Tokens the trainer used</h3><div class="box">branches: ${e.samples.map((s, k) => `<button data-k="${k}" data-testid="sample-${k}">branch ${s.branch}: ${s.tokens} tok, ${s.masked} sampled, ${s.turns} turns, v${s.versions.join(",")}</button>`).join(" ") || "<span class=muted>no samples</span>"}
      <div class="legend-tok" style="margin-top:6px"><span><i class="sw" style="background:#fff"></i><span class="muted">prompt (mask 0)</span></span><span><i class="sw" style="background:${shade(0)}"></i>sampled, p≈1</span><span><i class="sw" style="background:${shade(-3)}"></i>sampled, p≈0.05</span><span><i class="sw" style="outline:2px solid #c0392b"></i>drift (tito audit)</span></div>
      <div id="tokstats" data-testid="tokstats" class="muted"></div></div><div id="tokens" class="tokens" data-testid="tokens"></div>`;
  for (const b of document.querySelectorAll("button[data-k]")) b.onclick = () => loadTokens(id, +b.dataset.k);
  if (e.samples.length) await loadTokens(id, 0);
}

async function loadTokens(id, k) {
  const d = await api(`/api/episodes/${encodeURIComponent(id)}/tokens/${k}`);
  S.tok = d;
  const s = tokenSummary(d), box = $("#tokstats");
  box.dataset.masked = s.masked; box.dataset.total = s.total; box.dataset.drift = d.drift.length;
  box.innerHTML = `branch ${d.branch}: ${s.total} tokens, <b>${s.masked}</b> loss-masked (sampled), ${s.prompt} prompt; mean logprob ${fmt(s.meanLp)}; ` +
    `drift: ${d.drift.length ? `<span class="err">${d.drift.map(x => esc(x.kind + " @" + (x.token ?? "?"))).join(", ")}</span>` : "none"}` +
    (d.pieces ? "" : ` <span class="err">(ids only: ${esc(d.tokenizer_error || "")})</span>`);
  $("#tokens").innerHTML = renderTokens(d);
  document.body.dataset.tokensReady = `${id}:${k}`;
  requestAnimationFrame(() => { document.body.dataset.tokensPaint = performance.now().toFixed(1); });
}

async function renderGroup(gid) {
  const g = await api(`/api/groups/${encodeURIComponent(gid)}`);
  $("#main").innerHTML = `<h2>Group ${esc(g.group)} <span class="muted">(${g.episodes.length} episodes, ${esc(g.advantage_kind)} advantages)</span></h2>
    <div class="group" data-testid="group">${g.episodes.map(e => `<div class="col" data-testid="group-col">
      <div><a href="#/episode/${encodeURIComponent(e.id)}">${esc(e.id)}</a> ${pill(e.status)}</div>
      <div>reward <b>${num(e.reward)}</b></div><div class="adv ${e.advantage > 0 ? "pos" : e.advantage < 0 ? "neg" : ""}" data-testid="advantage">A = ${num(e.advantage)}</div>
      <div class="muted">${e.turns} turns · ${e.sampled} sampled · v${e.v_min ?? "–"} · step ${e.step ?? "–"}</div>
      <h3>commands</h3>${e.commands.map(c => `<div class="cmd"><pre>$ ${esc(c.command)}  [${c.exit_code ?? "?"}]</pre></div>`).join("") || "<span class=muted>none</span>"}
      <h3>final answer</h3><div class="msg assistant"><pre>${esc((e.final || "").slice(0, 1500))}</pre></div></div>`).join("")}</div>`;
}

async function route() {
  const [, page, arg] = (location.hash || "#/run").split("/");
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("on", a.id === `nav-${page}`);
  try {
    if (page === "episodes") renderEpisodesShell();
    else if (page === "episode") await renderEpisode(decodeURIComponent(arg));
    else if (page === "group") await renderGroup(decodeURIComponent(location.hash.slice("#/group/".length)));
    else renderRun();
  } catch (err) { $("#main").innerHTML = `<p class="err">${esc(err.message)}</p>`; }
}

async function poll() {
  try {
    const live = await api("/api/live"), old = S.live;
    S.live = live;
    $("#live").className = "on";
    $("#live").textContent = `live · ${live.metrics} metric rows · ${live.episodes} episodes · ${new Date().toLocaleTimeString()}`;
    const page = (location.hash || "#/run").split("/")[1];
    if (!old || live.metrics !== old.metrics) { await loadMetrics(); if (page === "run" || !location.hash) renderRun(); }
    if (old && live.changes !== old.changes) {
      S.run = await api("/api/run");
      if (page === "episodes") loadTable();
    }
  } catch (err) { $("#live").className = ""; $("#live").textContent = "offline: " + err.message; }
}

document.addEventListener("mouseover", e => {
  const t = e.target, tip = $("#tip");
  if (t.dataset && t.dataset.i !== undefined && S.tok) {
    tip.textContent = tokenTip(S.tok, +t.dataset.i); tip.hidden = false;
    const r = t.getBoundingClientRect(); tip.style.left = `${r.left}px`; tip.style.top = `${r.bottom + 4}px`;
  } else tip.hidden = true;
});

(async () => {
  S.run = await api("/api/run");
  $("#where").textContent = S.run.root;
  await poll();
  window.addEventListener("hashchange", route);
  await route();
  setInterval(poll, 2000);
})();

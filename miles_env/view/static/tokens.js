// The token view: every token of one exported sample, as the trainer saw it.
// Prompt tokens (loss mask 0) are grey; sampled tokens (mask 1) are shaded by their logprob
// (white = probability 1, red = improbable). Turn boundaries carry the turn's weight version;
// a drift the audit found is outlined at the token where it starts. Built as one HTML string.
"use strict";

function esc(s) {
  return String(s).replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

function shade(lp) {
  if (lp === null) return "#fdd";
  const p = Math.exp(Math.max(lp, -20));
  const a = Math.min(1, Math.max(0, 1 - p));  // 0 when certain
  const light = 97 - a * 30;
  return `hsl(${a < 0.5 ? 140 : 10},${30 + a * 50}%,${light}%)`;
}

function renderTokens(data) {
  const { ids, mask, logprobs, pieces, turns, drift } = data;
  const starts = new Map();
  turns.forEach((t, k) => starts.set(t.start, [k, t]));
  const drifts = new Map();
  for (const d of drift) if (d.token !== null && d.token !== undefined) drifts.set(d.token, d);
  const parts = [];
  for (let i = 0; i < ids.length; i++) {
    if (starts.has(i)) {
      const [k, t] = starts.get(i);
      parts.push(`<span class="turn v" data-turn="${k}">turn ${k} · v${t.weight_version} · ${esc(t.finish_reason)}</span>`);
    }
    if (drifts.has(i)) parts.push(`<span class="drift" data-testid="drift">drift: ${esc(drifts.get(i).kind)}</span>`);
    const text = pieces ? pieces[i].replace(/\n/g, "↵\n") : `[${ids[i]}]`;
    const cls = (mask[i] ? "s" : "p") + (drifts.has(i) ? " d" : "");
    const style = mask[i] ? ` style="background:${shade(logprobs[i])}"` : "";
    parts.push(`<span class="${cls}" data-i="${i}"${style}>${esc(text || "∅")}</span>`);
  }
  return parts.join("");
}

function tokenSummary(data) {
  const masked = data.mask.reduce((a, b) => a + b, 0);
  const sampledLp = data.logprobs.filter((lp, i) => data.mask[i] && lp !== null);
  const mean = sampledLp.length ? sampledLp.reduce((a, b) => a + b, 0) / sampledLp.length : null;
  return { total: data.ids.length, masked, prompt: data.ids.length - masked, meanLp: mean };
}

function tokenTip(data, i) {
  const lp = data.logprobs[i];
  const turn = data.turns.filter(t => t.start <= i).pop();
  return `#${i}  id ${data.ids[i]}  ${data.mask[i] ? "sampled (mask 1)" : "prompt (mask 0)"}` +
    (data.mask[i] ? `\nlogprob ${lp === null ? "non-finite" : lp.toFixed(4)}  p=${lp === null ? "?" : Math.exp(lp).toFixed(3)}` : "") +
    (turn ? `\nweight version ${turn.weight_version}` : "");
}

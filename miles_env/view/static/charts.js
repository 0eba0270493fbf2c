// Small SVG line charts, no dependencies: lineChart(title, series, opts) -> HTMLElement.
// series: [{name, color, points: [[x, y], ...], dashed}]; a null y is skipped.
"use strict";
const COLORS = ["#2f6fdb", "#e8590c", "#1e8e3e", "#7a5af8", "#c0392b", "#0e9384", "#b58900"];

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const span = hi - lo, step0 = span / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => span / s <= n) || 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) out.push(+v.toPrecision(12));
  return out;
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  if (a >= 100) return v.toFixed(0);
  return (+v.toPrecision(3)).toString();
}

function lineChart(title, series, opts = {}) {
  const el = document.createElement("div");
  el.className = "chart";
  el.dataset.testid = "chart";
  el.dataset.title = title;
  const head = `<div class="t">${title}</div>`;
  const pts = series.flatMap(s => s.points.filter(p => p[1] !== null && p[1] !== undefined && isFinite(p[1])));
  if (!pts.length) {
    el.innerHTML = head + `<div class="empty">${opts.empty || "not reported by this run"}</div>`;
    return el;
  }
  const W = 380, H = 170, L = 44, R = 8, T = 8, B = 22;
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (opts.yMin !== undefined) y0 = Math.min(y0, opts.yMin);
  if (opts.yMax !== undefined) y1 = Math.max(y1, opts.yMax);
  if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1) * 0.5; y0 = y0 - (y1 - y0); }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  let svg = `<svg viewBox="0 0 ${W} ${H}" width="100%" role="img" aria-label="${title}">`;
  for (const t of niceTicks(y0, y1, 4)) {
    svg += `<line x1="${L}" x2="${W - R}" y1="${Y(t)}" y2="${Y(t)}" stroke="#eef0f3"/>`;
    svg += `<text x="${L - 4}" y="${Y(t) + 3}" text-anchor="end">${fmt(t)}</text>`;
  }
  const xt = niceTicks(x0, x1, 6), xi = xt.filter(t => Number.isInteger(t));
  for (const t of (xi.length >= 2 ? xi : xt)) {
    svg += `<text x="${X(t)}" y="${H - 6}" text-anchor="middle">${fmt(t)}</text>`;
  }
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    const ps = s.points.filter(p => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
    if (!ps.length) return;
    const d = ps.map((p, j) => `${j ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    svg += `<path d="${d}" fill="none" stroke="${color}" stroke-width="1.8"${s.dashed ? ' stroke-dasharray="5 3"' : ""}/>`;
    if (ps.length <= 200) {
      for (const p of ps) {
        svg += `<circle cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}" r="2.6" fill="${color}"><title>${s.name} @ step ${p[0]}: ${fmt(p[1])}</title></circle>`;
      }
    }
  });
  svg += "</svg>";
  const legend = series.filter(s => s.points.length).map((s, i) =>
    `<span><i style="background:${s.color || COLORS[i % COLORS.length]}"></i>${s.name} <b>${fmt(lastY(s.points))}</b></span>`).join("");
  el.innerHTML = head + svg + `<div class="legend">${legend}</div>`;
  return el;
}

function lastY(points) {
  for (let i = points.length - 1; i >= 0; i--) if (points[i][1] !== null && isFinite(points[i][1])) return points[i][1];
  return null;
}

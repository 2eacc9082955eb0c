// The monitor's dashboard: re-reads the JSON API when the service's event stream says something
// was stored (push), and redraws what changed; it polls only while the stream is not open.
"use strict";

const POLL_MS = 1000;          // polling while the event stream is not open
const QUIET_POLL_MS = 5000;    // with the stream open: the "N s ago" texts still move on
const MAX_COLUMNS = 128;  // more DP ranks than this: columns are aggregated (max per group)
// windows of S over time the job page fetches (older ones: by index); ?history=N changes it
const HISTORY = Number(new URLSearchParams(location.search).get("history")) || 2000;

function text(el, value) { el.textContent = value; }
// A job's own strings (a host name from its meta.json) as text in Plotly's hover and labels,
// which Plotly reads as markup (links, styles): every character that starts markup escaped.
function plain(value) {
  return String(value).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
}
function ago(t) {
  if (!t) return "never";
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(0)} min ago`;
}
function fmt(x, digits = 3) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }
function cell(tr, value, cls) {
  const td = document.createElement("td");
  if (value instanceof Node) td.appendChild(value); else td.textContent = value;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

// Calls refresh() on every change event, one call at a time (events during a call make one more).
function followChanges(refresh) {
  let running = false, again = false, lastRun = 0, stream = null;
  async function run() {
    if (running) { again = true; return; }
    running = true;
    try {
      do { again = false; lastRun = Date.now(); await refresh(); } while (again);
    } finally { running = false; }
  }
  if (window.EventSource) {
    stream = new EventSource("/api/events");
    stream.addEventListener("change", run);
  }
  setInterval(() => {
    const open = stream !== null && stream.readyState === EventSource.OPEN;
    if (!open || Date.now() - lastRun >= QUIET_POLL_MS) run();
  }, POLL_MS);
  run();
}

async function getJSON(url) {
  const r = await fetch(url, {cache: "no-store"});
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

// ---- job list ------------------------------------------------------------------------------

function startJobList() {
  const body = document.querySelector("#jobs tbody");
  async function refresh() {
    try {
      const data = await getJSON("/api/jobs");
      body.replaceChildren();
      for (const j of data.jobs) {
        const tr = document.createElement("tr");
        tr.dataset.job = j.job;
        const a = document.createElement("a");
        a.href = `/jobs/${encodeURIComponent(j.job)}`;
        a.textContent = j.job;
        cell(tr, a);
        cell(tr, j.world_size ?? "–");
        cell(tr, fmt(j.slowdown), "slowdown");
        cell(tr, j.state, `state-${j.state}`);
        cell(tr, ago(j.last_part_at));
        cell(tr, j.open_alerts, j.open_alerts ? "firing" : "");
        cell(tr, j.upload_dropped);
        body.appendChild(tr);
      }
      document.getElementById("empty").hidden = data.jobs.length > 0;
    } catch (e) { console.warn(e); }
  }
  followChanges(refresh);
}

// ---- job page ------------------------------------------------------------------------------

function heatmapTrace(win, dp, pp) {
  // x = DP rank, y = PP stage, colour = S_w from 1.0 to the window's largest score (at least
  // 1.5, so a window without stragglers stays pale); each cell shows its number. A fixed
  // 1.0–1.5 scale saturated every cell at S 2.57, and no worker stood out.
  const groups = dp > MAX_COLUMNS ? Math.ceil(dp / MAX_COLUMNS) : 1;
  const cols = Math.ceil(dp / groups);
  const z = Array.from({length: pp}, () => Array(cols).fill(null));
  const hover = Array.from({length: pp}, () => Array(cols).fill(""));
  for (const s of win.scores) {
    const c = Math.floor(s.dp / groups);
    if (z[s.pp] === undefined) continue;
    if (z[s.pp][c] === null || s.score > z[s.pp][c]) {
      z[s.pp][c] = s.score;
      const where = groups > 1 ? `dp ${c * groups}–${Math.min(dp, (c + 1) * groups) - 1} (max)` : `dp ${s.dp}`;
      hover[s.pp][c] = `${where}, pp ${s.pp}<br>rank ${s.rank}${s.host ? " on " + plain(s.host) : ""}` +
        `<br>S_w = ${s.score.toFixed(3)}${s.decomposed ? "" : " (S below 1.03: not attributed)"}`;
    }
  }
  const x = Array.from({length: cols}, (_, i) => groups > 1 ? i * groups : i);
  const top = Math.max(1.5, ...z.flat().filter(v => v !== null));
  const cells = pp * cols <= 1024;   // numbers in the cells while they can be read
  return {note: groups > 1 ? `${dp} DP ranks: each column is the max over ${groups} ranks.` : "",
          trace: {type: "heatmap", z, x, y: Array.from({length: pp}, (_, i) => i), text: hover,
                  hovertemplate: "%{text}<extra></extra>", zmin: 1.0, zmax: top,
                  texttemplate: cells ? "%{z:.2f}" : "", textfont: {size: 11},
                  colorscale: "YlOrRd", reversescale: true, colorbar: {title: {text: "S_w"}}}};
}

function startJobPage() {
  const job = decodeURIComponent(location.pathname.split("/").pop());
  const slider = document.getElementById("window-slider");
  const follow = document.getElementById("follow");
  document.title = `stragglers monitor: ${job}`;
  text(document.getElementById("job-title"), job);
  let last = null, shownWindow = null, info = null;

  slider.addEventListener("input", () => {
    follow.checked = Number(slider.value) === Number(slider.max);
    showWindow(Number(slider.value));
  });
  follow.addEventListener("change", () => { if (follow.checked) refresh(true); });

  async function showWindow(idx) {
    if (!info) return;
    // windows older than the history the page holds are fetched by index like any other
    let win = (info.window && info.window.idx === idx) ? info.window : null;
    if (!win) {
      try { win = await getJSON(`/api/jobs/${encodeURIComponent(job)}/windows/${idx}`); }
      catch (e) { return; }   // no such window (a gap): keep what is shown
    }
    shownWindow = idx;
    drawWindow(win);
  }

  function drawWindow(win) {
    text(document.getElementById("window-label"),
         `#${win.idx}: steps ${win.first_step}–${win.last_step}` +
         (win.reason !== "complete" ? ` (closed: job ${win.reason})` : "") +
         (win.missing_ranks.length ? `; ranks missing: ${win.missing_ranks.join(", ")}` : ""));
    const hm = heatmapTrace(win, info.dp || 1, info.pp || 1);
    Plotly.react("heatmap", [hm.trace], {
      margin: {t: 10, r: 10, b: 45, l: 50},
      xaxis: {title: {text: "DP rank"}, dtick: 1}, yaxis: {title: {text: "PP stage"}, dtick: 1}},
      {displayModeBar: false});
    // what the analysis changed of the window's rows (a rank's clock moved onto the others')
    text(document.getElementById("heatmap-note"),
         [hm.note, ...(win.notes || [])].filter(Boolean).join(" "));
    const list = document.getElementById("diagnosis");
    list.replaceChildren();
    const summary = document.getElementById("summary");
    if (win.error) {
      text(summary, `This window could not be analysed: ${win.error}`);
      return;
    }
    text(summary, `S = ${fmt(win.slowdown)} over steps ${win.first_step}–${win.last_step} ` +
         `(window ${win.idx}; waste ${fmt(100 * win.waste, 1)}%), ` +
         `M_W = ${fmt(win.m_w, 2)}, M_S = ${fmt(win.m_s, 2)}, ` +
         `replay error ${fmt(100 * (win.sim_error || 0), 1)}%. S is this window's: ` +
         `the whole run's (stragglers analyze, warm-up left out) averages over every step ` +
         `and differs where the job changes over time.`);
    for (const f of win.diagnosis) {
      const li = document.createElement("li");
      li.dataset.cause = f.cause;
      li.dataset.ranks = (f.ranks || []).join(",");
      const head = document.createElement("strong");
      head.textContent = f.headline || f.cause;
      li.appendChild(head);
      if (f.evidence) {
        const ev = document.createElement("div");
        ev.className = "muted";
        ev.textContent = f.evidence;
        li.appendChild(ev);
      }
      list.appendChild(li);
    }
  }

  function drawHistory() {
    const ws = info.windows.filter(w => w.slowdown !== null);
    Plotly.react("slowdown-chart", [{
      type: "scatter", mode: "lines+markers", x: ws.map(w => w.idx), y: ws.map(w => w.slowdown),
      text: ws.map(w => `steps ${w.first_step}–${w.last_step}<br>${plain(w.causes.join(", "))}`),
      hovertemplate: "window %{x}: S = %{y:.3f}<br>%{text}<extra></extra>"}], {
      margin: {t: 10, r: 10, b: 45, l: 50},
      // whole window numbers only, about a dozen of them (fractional ticks on few windows)
      xaxis: {title: {text: "window"}, tick0: 0, tickformat: "d", dtick: Math.max(1,
              Math.ceil((ws.length ? ws[ws.length - 1].idx - ws[0].idx + 1 : 1) / 12))},
      yaxis: {title: {text: "S"}, rangemode: "tozero"},
      shapes: [{type: "line", xref: "paper", x0: 0, x1: 1, y0: 1.1, y1: 1.1,
                line: {dash: "dot", color: "#b35900"}}]}, {displayModeBar: false});
  }

  function drawAlerts() {
    const body = document.querySelector("#alert-log tbody");
    body.replaceChildren();
    for (const e of info.alert_log) {
      const tr = document.createElement("tr");
      tr.dataset.rule = e.rule;
      tr.dataset.status = e.status;
      cell(tr, new Date(e.at * 1000).toLocaleTimeString());
      cell(tr, e.status, e.status);
      cell(tr, e.rule);
      cell(tr, e.severity);
      cell(tr, e.summary);
      body.appendChild(tr);
    }
  }

  async function refresh(force = false) {
    try {
      // the chart shows the last HISTORY windows; the slider reaches back to the first
      const data = await getJSON(`/api/jobs/${encodeURIComponent(job)}?history=${HISTORY}`);
      info = data;
      text(document.getElementById("state"), data.state);
      document.getElementById("state").className = `state-${data.state}`;
      text(document.getElementById("shape"),
           `dp ${data.dp} × pp ${data.pp} (world ${data.world_size}), windows of ${data.window_steps} steps`);
      text(document.getElementById("updated"), `last part ${ago(data.last_part_at)}`);
      const drops = Object.values(data.upload_dropped).reduce((a, b) => a + b, 0);
      text(document.getElementById("drops"), drops || data.skipped_parts
           ? `${drops} parts dropped by uploaders, ${data.skipped_parts} never arrived` : "");
      if (!force && data.version === last) return;
      last = data.version;
      drawHistory();
      drawAlerts();
      if (!data.windows.length) return;
      const latest = data.windows[data.windows.length - 1].idx;
      slider.min = data.first_window ?? data.windows[0].idx;
      slider.max = latest;
      if (follow.checked || shownWindow === null) {
        slider.value = latest;
        shownWindow = latest;
        drawWindow(data.window);
      }
      document.body.dataset.window = String(shownWindow);
    } catch (e) { console.warn(e); }
  }
  followChanges(refresh);
}

/* orin-llm dashboard: polls /dashboard/data once a second, draws the history with
   uPlot, shows the slots, and streams the playground's chat. Nothing here is
   inserted as HTML: every server value goes in through textContent. */
"use strict";

(() => {
  const POLL_MS = 1000;
  const HEIGHT = 170;
  // every colour at least 3:1 against the charts' background in both schemes (WCAG's
  // rule for graphics): #ffffff light, #1a1f27 dark
  const PALETTE = ["#2f6fde", "#e8590c", "#2b8a3e", "#ae3ec9", "#c92a2a", "#12869a", "#5c940d", "#8b5cf6"];

  const fmtInt = (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US"));
  const fmtMs = (v) => (v == null ? "–" : v < 10 ? v.toFixed(2) : v < 100 ? v.toFixed(1) : Math.round(v).toString());
  const fmtLat = (v) => (v == null ? "–" : v >= 1000 ? (v / 1000).toFixed(2) + " s" : fmtMs(v) + " ms");
  const fmtPct = (v) => (v == null ? "–" : Math.round(v * 100) + " %");
  const fmtGiB = (v) => (v == null ? "–" : (v / 2 ** 30).toFixed(2) + " GiB");
  const axisGiB = (v) => (v == null ? "" : Number((v / 2 ** 30).toFixed(2)) + " GiB");
  const fmtNum = (v) => (v == null ? "–" : v < 10 ? v.toFixed(1) : Math.round(v).toString());
  const fmtClock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB");
  const axisNum = (v) => (v == null ? "" : Number(v.toPrecision(4)).toLocaleString("en-US"));

  // memory ticks at round GiB figures (bytes' decimal steps read "0.47 GiB, 0.93 GiB")
  const GIB_STEPS = [1 / 4, 1 / 2, 1, 2, 4, 8, 16, 32, 64, 128, 256].map((g) => g * 2 ** 30);

  // One chart per entry; `optional` ones are shown only while the server reports a value,
  // and named under the charts when it does not: `absent` (why), or "telemetry is off"
  // for a `telemetry` one when the server has no telemetry source. `alt` is what it plots,
  // for a screen reader (the canvas has no text).
  const CHARTS = [
    { id: "throughput", title: "Tokens per second", unit: "tok/s", fmt: fmtNum, axis: axisNum,
      alt: "generated and prompt tokens per second, one point a second",
      series: [["tokens_per_s", "generated"], ["prompt_tokens_per_s", "prompt (prefill)"]] },
    { id: "ttft", title: "TTFT, requests of the last 60 s", unit: "ms", fmt: fmtMs, axis: axisNum,
      alt: "time to first token in milliseconds, p50 and p95 of the requests of the last 60 seconds",
      series: [["ttft_p50_ms", "p50"], ["ttft_p95_ms", "p95"]] },
    { id: "tpot", title: "TPOT, requests of the last 60 s", unit: "ms", fmt: fmtMs, axis: axisNum,
      alt: "time per output token in milliseconds, p50 and p95 of the requests of the last 60 seconds",
      series: [["tpot_p50_ms", "p50"], ["tpot_p95_ms", "p95"]] },
    { id: "load", title: "Slots and queue", fmt: fmtInt, counts: true,
      alt: "busy slots and queued requests",
      series: [["slots_busy", "busy slots"], ["queue", "queued requests"]] },
    { id: "gpu", title: "GPU utilization by phase", fmt: fmtPct, range: [0, 1], optional: true,
      name: "GPU utilization", absent: "no GPU counter in this telemetry source", telemetry: true,
      alt: "GPU utilization in percent while prefilling, while decoding and over all samples",
      series: [["gpu_util_prefill", "prefill"], ["gpu_util_decode", "decode"], ["gpu_util", "all samples"]] },
    { id: "memory", title: "Memory used (unified: CPU and GPU)", fmt: fmtGiB, axis: axisGiB, optional: true, incrs: GIB_STEPS,
      name: "memory", alt: "memory used in GiB, MemTotal minus MemAvailable, and a discrete GPU's memory", series: [["mem_used_bytes", "MemTotal − MemAvailable"], ["gpu_mem_used_bytes", "GPU memory (discrete GPU)"]] },
    { id: "kv", title: "KV cells", fmt: fmtInt, counts: true,
      alt: "KV cache cells held by requests and kept as prefixes",
      series: [["kv_cells_used", "held by requests"], ["kv_cells_cached", "kept as prefixes"]] },
    { id: "power", title: "Power (board)", unit: "W", fmt: fmtNum, axis: axisNum, optional: true,
      name: "power", absent: "the board reports no rails", telemetry: true,
      alt: "the board's power in watts", series: [["power_w", "power"]] },
    { id: "temp", title: "Temperatures", unit: "°C", fmt: fmtNum, axis: axisNum, optional: true,
      name: "temperatures", absent: "no thermal zone", dynamic: "temp_c", series: [],
      alt: "temperature of each thermal zone in degrees Celsius" },
  ];

  const COUNT_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
  const store = { cols: null, lastT: null, started: null, restartedAt: null, data: null };
  const charts = {}; // id -> { def, el, plot, keys }
  const $ = (id) => document.getElementById(id);

  function makeCharts() {
    const host = $("charts");
    for (const def of CHARTS) {
      const el = document.createElement("div");
      el.className = "chart";
      el.id = "chart-" + def.id;
      el.dataset.points = "0";
      const h = document.createElement("h3");
      h.textContent = def.title + (def.unit ? " (" + def.unit + ")" : "");
      const plot = document.createElement("div");
      plot.className = "plot";
      el.append(h, plot);
      if (def.optional) el.hidden = true;
      host.append(el);
      charts[def.id] = { def, el, target: plot, plot: null, keys: [] };
    }
    // the browser switched between light and dark: the charts are drawn anew in its colours
    window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
      for (const c of Object.values(charts)) {
        if (c.plot) c.plot.destroy();
        c.plot = null;
      }
      if (store.cols) drawCharts();
    });
    window.addEventListener("resize", () => {
      for (const c of Object.values(charts)) {
        if (c.plot) c.plot.setSize({ width: plotWidth(c), height: HEIGHT });
      }
    });
  }

  function plotWidth(c) {
    return Math.max(120, c.el.clientWidth - 24);
  }

  function uplotOpts(c, labels) {
    const def = c.def;
    // Without a cursor on the chart the legend shows each series' latest value.
    const latest = (u, v, si, idx) => {
      if (idx != null) return def.fmt(v);
      const col = u.data[si];
      for (let i = col.length - 1; i >= 0; i--) if (col[i] != null) return def.fmt(col[i]);
      return "–";
    };
    const series = [{ value: (u, v, si, idx) => (idx == null ? "latest" : fmtClock(v)) }]
      .concat(labels.map((label, i) => ({
        label, stroke: PALETTE[i % PALETTE.length], width: 1.5, points: { show: false }, value: latest,
      })));
    const y = { auto: true };
    if (def.range) y.range = def.range;
    else y.range = (u, min, max) => [Math.min(0, min ?? 0), Math.max(max ?? 1, 1)];
    // the page's colours (light or dark, as the browser is set): a canvas reads no CSS
    const css = getComputedStyle(document.documentElement);
    const ink = css.getPropertyValue("--muted").trim();
    const grid = { stroke: css.getPropertyValue("--grid").trim() };
    return {
      width: plotWidth(c), height: HEIGHT, series,
      scales: { x: { time: true }, y },
      // one line of wall-clock time under each tick (uPlot's default adds a date row,
      // whose labels collide at a minute boundary in a five-minute window)
      axes: [{ stroke: ink, grid, space: 60,
               values: (u, vals) => vals.map(fmtClock) },
             Object.assign({ stroke: ink, grid, size: 76,
               values: (u, vals) => vals.map((v) => (def.axis || def.fmt)(v)) },
               // counts tick at whole numbers only: 0.2 steps would print "0 0 0 1 1 1"
               def.counts ? { incrs: COUNT_STEPS } : def.incrs ? { incrs: def.incrs } : {})],
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
    };
  }

  // The columns a chart draws, and their legend labels.
  function chartColumns(c, cols) {
    if (c.def.dynamic) {
      const zones = Object.keys(cols[c.def.dynamic] || {}).sort();
      return { keys: zones, labels: zones, values: zones.map((z) => cols[c.def.dynamic][z]) };
    }
    const pairs = c.def.series.filter(([key]) => !c.def.optional || cols[key].some((v) => v != null));
    return { keys: pairs.map((p) => p[0]), labels: pairs.map((p) => p[1]), values: pairs.map((p) => cols[p[0]]) };
  }

  function drawCharts() {
    const cols = store.cols;
    const absent = [];
    const off = store.data != null && !store.data.telemetry.source;
    for (const c of Object.values(charts)) {
      const { keys, labels, values } = chartColumns(c, cols);
      const show = keys.length > 0;
      c.el.hidden = !show;
      if (!show) {
        const why = off && c.def.telemetry ? "telemetry is off" : c.def.absent;
        if (c.def.optional) absent.push(c.def.name + (why ? " (" + why + ")" : ""));
        continue;
      }
      const data = [cols.t].concat(values);
      if (!c.plot || keys.join("\n") !== c.keys.join("\n")) {
        if (c.plot) c.plot.destroy();
        c.plot = new uPlot(uplotOpts(c, labels), data, c.target);
        // the drawing (canvas and axes) is an image with a text; the legend under it,
        // the latest values, stays text a screen reader reads
        const wrap = c.plot.root.querySelector(".u-wrap");
        wrap.setAttribute("role", "img");
        wrap.setAttribute("aria-label", "Line chart of " + c.def.alt);
        c.keys = keys;
      } else {
        c.plot.setData(data);
      }
      c.el.dataset.points = String(cols.t.length);
    }
    $("absent").textContent = absent.length ? "Not reported here: " + absent.join("; ") + "." : "";
  }

  // Consecutive rows further apart than this many sampling intervals have a gap
  // between them (the server was down, or this tab asleep longer than the history):
  // a row of nulls goes in between, and uPlot breaks its lines there.
  const GAP_INTERVALS = 3;

  // `hist` with a row of nulls after each row (the one held before it, `prevT`,
  // included) that its successor is more than `maxGap` seconds after, or before
  // its first row when `restart` (a restarted server: nothing joins its rows to
  // the ones before, however short the downtime).
  function withGaps(prevT, hist, maxGap, restart) {
    const t = hist.t;
    const cuts = [];
    for (let i = 0; i < t.length; i++) {
      const before = i === 0 ? prevT : t[i - 1];
      if (before != null && (t[i] - before > maxGap || (i === 0 && restart))) cuts.push(i);
    }
    if (!cuts.length) return hist;
    const gapped = (col, gapT) => {
      const out = [];
      let from = 0;
      for (const i of cuts) {
        out.push(...col.slice(from, i), gapT ? gapT(i) : null);
        from = i;
      }
      out.push(...col.slice(from));
      return out;
    };
    const out = { temp_c: {} };
    for (const key of Object.keys(hist)) {
      if (key === "t") out.t = gapped(t, (i) => Math.min(t[i], (i === 0 ? prevT : t[i - 1]) + maxGap / GAP_INTERVALS));
      else if (key === "temp_c") for (const z of Object.keys(hist.temp_c)) out.temp_c[z] = gapped(hist.temp_c[z]);
      else out[key] = gapped(hist[key]);
    }
    return out;
  }

  // Append the rows after the newest one held, marking the gaps, and keep those of
  // the last `windowS` seconds (the server's history: hours in a tab keep that many).
  function merge(hist, interval, windowS, restart) {
    hist = withGaps(store.lastT, hist, GAP_INTERVALS * interval, restart);
    if (!store.cols) {
      store.cols = hist;
    } else {
      const cols = store.cols;
      const n = hist.t.length;
      cols.t.push(...hist.t);
      for (const key of Object.keys(hist)) {
        if (key === "t") continue;
        if (key === "temp_c") {
          const known = cols.temp_c;
          const before = cols.t.length - n;
          for (const zone of new Set([...Object.keys(known), ...Object.keys(hist.temp_c)])) {
            if (!known[zone]) known[zone] = new Array(before).fill(null);
            known[zone].push(...(hist.temp_c[zone] || new Array(n).fill(null)));
          }
        } else {
          cols[key].push(...hist[key]);
        }
      }
    }
    const cols = store.cols;
    const newest = cols.t.length ? cols.t[cols.t.length - 1] : null;
    let extra = 0;
    while (extra < cols.t.length && cols.t[extra] <= newest - windowS) extra++;
    if (extra > 0) {
      for (const key of Object.keys(cols)) {
        if (key === "temp_c") {
          for (const z of Object.keys(cols.temp_c)) {
            cols.temp_c[z].splice(0, extra);
            // a zone gone from every row held (its sensor switched off) leaves the chart
            if (cols.temp_c[z].every((v) => v == null)) delete cols.temp_c[z];
          }
        } else cols[key].splice(0, extra);
      }
    }
    if (newest != null) store.lastT = newest;
  }

  function last(key) {
    const col = store.cols && store.cols[key];
    return col && col.length ? col[col.length - 1] : null;
  }

  function drawNow(d) {
    const now = d.now;
    $("model").textContent = d.model;
    const m = d.meta || {};
    $("meta").textContent = [m.quantization, m.slots + " slots × " + m.n_ctx_per_slot + " tokens",
      "K " + m.type_k + " / V " + m.type_v, "telemetry: " + (d.telemetry.source || "off"),
      "v" + d.version, "started " + fmtClock(d.started)].filter(Boolean).join(" · ");
    document.title = "orin-llm · " + d.model;
    $("restarted").hidden = store.restartedAt == null;
    $("restarted").textContent = store.restartedAt == null ? "" : "server restarted at " + fmtClock(store.restartedAt);
    $("logout").hidden = !d.auth;
    $("tile-slots").textContent = now.slots_busy + " / " + now.slots_total;
    $("tile-queue").textContent = fmtInt(now.queue);
    $("tile-kv").textContent = fmtInt(now.kv_cells_used) + " / " + fmtInt(now.kv_cells_total);
    $("tile-tps").textContent = fmtNum(last("tokens_per_s"));
    $("tile-ttft").textContent = fmtLat(last("ttft_p50_ms")) + " / " + fmtLat(last("ttft_p95_ms"));
    $("tile-tpot").textContent = fmtLat(last("tpot_p50_ms")) + " / " + fmtLat(last("tpot_p95_ms"));
    $("tile-mem").textContent = fmtGiB(last("mem_used_bytes"));
    $("tile-phase").textContent = d.telemetry.phase || (d.telemetry.source ? "idle" : "telemetry off");
    drawSlots(now);
  }

  function drawSlots(now) {
    $("slots-sub").textContent = now.slots_busy + " busy of " + now.slots_total + ", " + now.queue + " queued";
    const body = $("slots-body");
    const rows = [];
    for (const s of now.slots) {
      const tr = document.createElement("tr");
      tr.dataset.slot = String(s.id);
      tr.dataset.state = s.state;
      const cells = [String(s.id), s.state, s.request_id || "", s.is_processing ? fmtInt(s.prompt_tokens) : "",
        s.is_processing ? fmtInt(s.cached_prompt_tokens) : "", s.is_processing ? fmtInt(s.generated_tokens) : ""];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (i === 1) td.className = "state-" + s.state;
        tr.append(td);
      });
      const td = document.createElement("td");
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.style.width = Math.min(100, (100 * s.cells_used) / Math.max(1, s.n_ctx)).toFixed(1) + "%";
      bar.append(fill);
      td.append(bar, document.createTextNode(fmtInt(s.cells_used) + " / " + fmtInt(s.n_ctx)));
      tr.append(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  function setConn(state, text) {
    const el = $("conn");
    el.dataset.state = state;
    el.textContent = text;
  }

  async function poll() {
    const url = "/dashboard/data" + (store.lastT != null ? "?since=" + encodeURIComponent(store.lastT) : "");
    try {
      const r = await fetch(url, { cache: "no-store", credentials: "same-origin" });
      if (r.status === 401) {
        window.location.assign("/");
        return;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      const d = await r.json();
      store.data = d;
      // a server that started since the last answer is another process: its history
      // begins after a downtime, however short
      const restart = store.started != null && d.started !== store.started;
      if (restart) store.restartedAt = d.started;
      store.started = d.started;
      if (d.history) merge(d.history, d.interval_s, d.history_s, restart);
      drawNow(d);
      if (store.cols) drawCharts();
      setConn("live", "live · " + d.state);
    } catch (e) {
      setConn("error", "no answer from the server (" + e.message + ")");
    } finally {
      window.setTimeout(poll, POLL_MS);
    }
  }

  // -- playground ------------------------------------------------------------------

  const chat = { messages: [], abort: null };

  function addMessage(role, text) {
    const el = document.createElement("div");
    el.className = "msg " + role;
    el.textContent = text;
    $("chat-log").append(el);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return el;
  }

  // Server-sent events from a fetch body: "data: {...}" lines, events split by a blank line.
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data) yield data;
      }
    }
  }

  async function send(text) {
    chat.messages.push({ role: "user", content: text });
    const asked = addMessage("user", text);
    const out = addMessage("assistant", "");
    out.dataset.streaming = "true";
    const controller = new AbortController();
    chat.abort = controller;
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    let answer = "";
    try {
      const body = {
        model: store.data ? store.data.model : undefined,
        messages: chat.messages,
        stream: true,
        max_tokens: Number($("chat-max").value) || 128,
        temperature: Number($("chat-temp").value),
      };
      const r = await fetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, credentials: "same-origin",
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!r.ok) {
        const err = await r.json().catch(() => null);
        throw new Error((err && err.error && err.error.message) || "HTTP " + r.status);
      }
      for await (const data of sseEvents(r.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "generation failed");
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) {
            answer += delta.content;
            out.textContent = answer;
            $("chat-log").scrollTop = $("chat-log").scrollHeight;
          }
        }
      }
      chat.messages.push({ role: "assistant", content: answer });
    } catch (e) {
      const stopped = e.name === "AbortError";
      if (!stopped) {
        out.classList.add("error");
        out.textContent = (answer ? answer + "\n" : "") + "[" + e.message + "]";
      }
      if (!asked.isConnected) {
        // Clear emptied the log and the conversation: nothing of this exchange stays
      } else if (answer) {
        chat.messages.push({ role: "assistant", content: answer });
      } else {
        // nothing came back: the question leaves the conversation and goes back into
        // the input box, so that it can be sent again; stopped before its first token,
        // it leaves no bubbles behind either
        chat.messages.pop();
        if (stopped) {
          out.remove();
          asked.remove();
        }
        if (!$("chat-input").value) $("chat-input").value = text;
      }
    } finally {
      out.dataset.streaming = "false";
      chat.abort = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
    }
  }

  function setupChat() {
    $("chat-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("chat-input").value.trim();
      if (!text || chat.abort) return;
      $("chat-input").value = "";
      send(text);
    });
    $("chat-input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) {
        ev.preventDefault();
        $("chat-form").requestSubmit();
      }
    });
    $("chat-stop").addEventListener("click", () => chat.abort && chat.abort.abort());
    $("chat-clear").addEventListener("click", () => {
      if (chat.abort) chat.abort.abort();
      chat.messages = [];
      $("chat-log").replaceChildren();
    });
  }

  // what the page holds, for a look from the browser's console (and the browser tests)
  window.orinDashboard = Object.freeze({ store, charts, chat });

  makeCharts();
  setupChat();
  poll();
})();
